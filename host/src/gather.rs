//! Work that goes out together: the reads that reach a cache or a store at about the
//! same moment are sent as one batch (one guest call, one request on the connection)
//! instead of one each, as rueidis's auto-pipelining does for every command.
//!
//! The first to arrive leads: it yields once, so that the tasks already woken run and
//! join it, then does its own work and theirs at once and hands each its answer. A
//! read that finds no other under way goes at once, as it would without gathering. Only work not yet sent is joined, never a request in flight:
//! every read still starts after its caller called, so it sees every write that ended
//! before (a read joining an earlier request could miss one).
//!
//! A leader dropped before it answers (its caller cancelled) drops its followers'
//! replies with it: each then does its work alone.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::oneshot;

/// The most one batch carries; work arriving at a full gathering goes alone.
pub(crate) const MAX_GATHERED: usize = 256;

/// Room a gathering makes for its followers when the first joins: about as many as
/// join one on a busy connection, so that most gatherings never grow their list (and
/// one nobody joins allocates nothing).
const FOLLOWERS_AT_FIRST: usize = 32;

/// The distinct items of `items` in the order they first come, and for each item the
/// place of its twin among them: what a leader asks once however many asked for it
/// (every asker called before it is sent, so the answer is as good as its own).
/// Its callers hand it one gathering's items, at most [`MAX_GATHERED`], so a fast hash
/// with a random seed is enough: even keys chosen to collide cost a bounded number of
/// comparisons.
pub(crate) fn distinct<T: Copy + Eq + std::hash::Hash>(
    items: impl IntoIterator<Item = T>,
) -> (Vec<T>, Vec<usize>) {
    let items = items.into_iter();
    let (count, _) = items.size_hint();
    debug_assert!(count <= MAX_GATHERED, "one gathering's items at most");
    let mut distinct = Vec::with_capacity(count);
    let mut seen =
        std::collections::HashMap::with_capacity_and_hasher(count, foldhash::fast::RandomState::default());
    let at = items
        .into_iter()
        .map(|item| {
            *seen.entry(item).or_insert_with(|| {
                distinct.push(item);
                distinct.len() - 1
            })
        })
        .collect();
    (distinct, at)
}

/// The answers to the distinct items, spread back over every asker (`at` as
/// [`distinct`] gives it): each answer moves to its last asker and is copied for the
/// others; `None` for a place no answer covers.
pub(crate) fn spread<A: Clone>(answers: Vec<A>, at: &[usize]) -> Vec<Option<A>> {
    let mut askers = vec![0usize; answers.len()];
    for &i in at {
        if let Some(n) = askers.get_mut(i) {
            *n += 1;
        }
    }
    let mut answers: Vec<Option<A>> = answers.into_iter().map(Some).collect();
    at.iter()
        .map(|&i| {
            let last = askers.get_mut(i).is_some_and(|n| {
                *n -= 1;
                *n == 0
            });
            let answer = answers.get_mut(i)?;
            if last { answer.take() } else { answer.clone() }
        })
        .collect()
}

/// One piece of work waiting to go out with a leader's: what it asks, and where its
/// answer goes.
pub(crate) struct Follower<Q, A> {
    pub(crate) query: Q,
    reply: oneshot::Sender<Heard<Q, A>>,
}

/// What a follower hears from its leader: its answer, or a gathering of its own to
/// lead (work the leader hands over, [`keep_part`]).
enum Heard<Q, A> {
    Answer(A),
    Lead(Vec<Follower<Q, A>>),
}

impl<Q, A> Follower<Q, A> {
    /// Hands the follower its answer (none needed if it stopped waiting).
    pub(crate) fn answer(self, answer: A) {
        let _ = self.reply.send(Heard::Answer(answer));
    }
}

/// Keeps the followers whose part (`parts`, one per follower, in order) is `mine`, and
/// hands each other part's followers to the first of them still waiting, which leads
/// them as if it had led their gathering: no part's work waits on another's (on a
/// cluster, a part is a slot or a node, and a frozen node delays its own reads only).
pub(crate) fn keep_part<Q, A, P: PartialEq>(
    followers: Vec<Follower<Q, A>>,
    parts: impl IntoIterator<Item = P>,
    mine: &P,
) -> Vec<Follower<Q, A>> {
    let mut kept = Vec::with_capacity(followers.len());
    let mut others: Vec<(P, Vec<Follower<Q, A>>)> = Vec::new();
    for (follower, part) in followers.into_iter().zip(parts) {
        if part == *mine {
            kept.push(follower);
        } else if let Some((_, group)) = others.iter_mut().find(|(p, _)| *p == part) {
            group.push(follower);
        } else {
            others.push((part, vec![follower]));
        }
    }
    for (_, group) in others {
        let mut group = group.into_iter();
        while let Some(first) = group.next() {
            match first.reply.send(Heard::Lead(group.collect())) {
                Ok(()) => break,
                // It stopped waiting: the next one leads.
                Err(Heard::Lead(rest)) => group = rest.into_iter(),
                Err(Heard::Answer(_)) => unreachable!("a hand-over was sent"),
            }
        }
    }
    kept
}

/// The work gathering now, if a gathering is open, and the next gathering's number.
pub(crate) struct Gather<Q, A> {
    open: Mutex<(u64, Option<Open<Q, A>>)>,
    /// Pieces of work under way ([`run`](Gather::run)): one that finds none works alone
    /// at once, without the leader's yield.
    running: AtomicUsize,
}

/// An open gathering: its number, and the work that joined it.
struct Open<Q, A> {
    id: u64,
    followers: Vec<Follower<Q, A>>,
}

impl<Q, A> Default for Gather<Q, A> {
    fn default() -> Self {
        Gather {
            open: Mutex::new((0, None)),
            running: AtomicUsize::new(0),
        }
    }
}

/// Counts one piece of work under way until dropped.
struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A piece of work's part in a gathering.
pub(crate) enum Turn<'a, Q, A> {
    /// Gather the others, then do all ([`Lead::close`]).
    Lead(Lead<'a, Q, A>),
    /// Wait for the leader's answer ([`Waiting`]).
    Follow(Waiting<Q, A>),
    /// The gathering is full: work alone.
    Alone,
}

/// A follower's place: the gathering it joined, where in it, and its answer to come.
pub(crate) struct Waiting<Q, A> {
    id: u64,
    at: usize,
    answer: oneshot::Receiver<Heard<Q, A>>,
}

impl<Q, A> Gather<Q, A> {
    /// Does one piece of work, gathered: as the leader, yields once for the others to
    /// join, then hands them (never none) to `together`, which answers each and returns
    /// the leader's own answer, or `None` to let them go. A follower yields once too:
    /// if its gathering is still open then (its leader was not polled again: a future
    /// set aside in a `select!`), it takes the gathering over and leads it. It waits
    /// for an answer at most `wait`; a part of the gathering its leader hands it, it
    /// leads. Whatever is not done together is done `alone`.
    pub(crate) async fn run<Alone, Together>(
        &self,
        query: impl FnOnce() -> Q,
        wait: std::time::Duration,
        alone: impl FnOnce() -> Alone,
        together: impl FnOnce(Vec<Follower<Q, A>>) -> Together,
    ) -> A
    where
        Alone: Future<Output = A>,
        Together: Future<Output = Option<A>>,
    {
        let others = self.running.fetch_add(1, Ordering::Relaxed);
        let _running = Running(&self.running);
        if others == 0 {
            // Nothing else under way: nobody to wait for.
            return alone().await;
        }
        let followers = match self.join(query) {
            Turn::Alone => return alone().await,
            Turn::Follow(waiting) => {
                tokio::task::yield_now().await;
                match self.take_over(&waiting) {
                    Some(followers) => followers,
                    None => match tokio::time::timeout(wait, waiting.answer).await {
                        Ok(Ok(Heard::Answer(answer))) => return answer,
                        Ok(Ok(Heard::Lead(followers))) => followers,
                        _ => return alone().await,
                    },
                }
            }
            Turn::Lead(lead) => {
                tokio::task::yield_now().await;
                lead.close()
            }
        };
        if followers.is_empty() {
            return alone().await;
        }
        match together(followers).await {
            Some(mine) => mine,
            None => alone().await,
        }
    }

    /// Joins the gathering under way with `query`, or starts one.
    pub(crate) fn join(&self, query: impl FnOnce() -> Q) -> Turn<'_, Q, A> {
        let mut guard = self.open.lock();
        let (next, open) = &mut *guard;
        match open {
            None => {
                let id = *next;
                *next = next.wrapping_add(1);
                *open = Some(Open {
                    id,
                    followers: Vec::new(),
                });
                Turn::Lead(Lead {
                    gather: Some(self),
                    id,
                })
            }
            Some(o) if o.followers.len() + 1 < MAX_GATHERED => {
                let (reply, answer) = oneshot::channel();
                if o.followers.is_empty() {
                    o.followers.reserve(FOLLOWERS_AT_FIRST);
                }
                o.followers.push(Follower {
                    query: query(),
                    reply,
                });
                Turn::Follow(Waiting {
                    id: o.id,
                    at: o.followers.len() - 1,
                    answer,
                })
            }
            Some(_) => Turn::Alone,
        }
    }

    /// Closes the gathering `waiting` joined if it is still open: the others in it (the
    /// follower's own place taken out), for the follower to lead.
    fn take_over(&self, waiting: &Waiting<Q, A>) -> Option<Vec<Follower<Q, A>>> {
        let mut followers = self.close(waiting.id)?;
        followers.swap_remove(waiting.at);
        Some(followers)
    }

    /// Closes gathering `id` if it is the one open: the work that joined it.
    fn close(&self, id: u64) -> Option<Vec<Follower<Q, A>>> {
        let mut guard = self.open.lock();
        let open = &mut guard.1;
        if open.as_ref().is_some_and(|o| o.id == id) {
            open.take().map(|o| o.followers)
        } else {
            None
        }
    }
}

/// The leader's hold on a gathering: closing it takes the followers; dropping it
/// unclosed lets them go (each works alone).
pub(crate) struct Lead<'a, Q, A> {
    /// `None` once closed.
    gather: Option<&'a Gather<Q, A>>,
    id: u64,
}

impl<Q, A> Lead<'_, Q, A> {
    /// Ends the gathering: the work that joined it, in the order it came (none if a
    /// follower took it over). The next comer starts another.
    pub(crate) fn close(mut self) -> Vec<Follower<Q, A>> {
        self.end()
    }

    fn end(&mut self) -> Vec<Follower<Q, A>> {
        self.gather
            .take()
            .and_then(|g| g.close(self.id))
            .unwrap_or_default()
    }
}

impl<Q, A> Drop for Lead<'_, Q, A> {
    fn drop(&mut self) {
        // Unanswered: the followers' replies are dropped, and each works alone.
        drop(self.end());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Reads = Gather<&'static str, u32>;

    const WAIT: std::time::Duration = std::time::Duration::from_secs(5);

    #[test]
    fn the_first_comer_leads_and_the_next_ones_follow_until_it_closes() {
        let gather = Reads::default();
        let Turn::Lead(lead) = gather.join(|| "a") else {
            panic!("the first leads")
        };
        let Turn::Follow(mut waiting) = gather.join(|| "b") else {
            panic!("the second follows")
        };
        let followers = lead.close();
        assert_eq!(followers.len(), 1);
        assert_eq!(followers[0].query, "b");
        assert!(
            matches!(gather.join(|| "c"), Turn::Lead(_)),
            "closed: the next one leads"
        );
        for f in followers {
            f.answer(7);
        }
        assert!(matches!(waiting.answer.try_recv(), Ok(Heard::Answer(7))));
    }

    #[test]
    fn a_leader_dropped_unanswered_lets_its_followers_go() {
        let gather = Reads::default();
        let lead = gather.join(|| "a");
        let Turn::Follow(mut waiting) = gather.join(|| "b") else {
            panic!("the second follows")
        };
        drop(lead);
        assert!(
            waiting.answer.try_recv().is_err(),
            "no answer will come: the follower works alone"
        );
        assert!(matches!(gather.join(|| "c"), Turn::Lead(_)), "the next one leads");
    }

    #[test]
    fn a_closed_leaders_end_leaves_the_next_gathering_alone() {
        let gather = Reads::default();
        let Turn::Lead(first) = gather.join(|| "a") else {
            panic!("leads")
        };
        assert!(first.close().is_empty());
        let _second = gather.join(|| "b");
        let Turn::Follow(mut waiting) = gather.join(|| "c") else {
            panic!("follows the second")
        };
        assert!(
            matches!(
                waiting.answer.try_recv(),
                Err(oneshot::error::TryRecvError::Empty)
            ),
            "the first leader's end did not take the second's followers"
        );
    }

    #[tokio::test]
    async fn work_that_finds_nothing_else_under_way_goes_at_once_and_alone() {
        let gather = Reads::default();
        let answer = gather
            .run(|| "a", WAIT, || async { 1 }, |_| async { Some(2) })
            .await;
        assert_eq!(answer, 1, "done alone");
        assert!(
            matches!(gather.join(|| "b"), Turn::Lead(_)),
            "and no gathering left open"
        );
    }

    #[tokio::test]
    async fn work_that_finds_others_under_way_gathers_with_them() {
        let gather = Reads::default();
        let (done, finished) = oneshot::channel::<u32>();
        let (busy, lead, follow) = tokio::join!(
            // Under way until the follower has its answer.
            gather.run(
                || "a",
                WAIT,
                move || async move { finished.await.unwrap() },
                |_| async { None }
            ),
            gather.run(
                || "b",
                WAIT,
                || async { 1 },
                |followers| async move {
                    assert_eq!(followers.len(), 1, "the third joined the second");
                    for f in followers {
                        f.answer(10);
                    }
                    Some(2)
                }
            ),
            async {
                let answer = gather.run(|| "c", WAIT, || async { 3 }, |_| async { None }).await;
                done.send(7).unwrap();
                answer
            },
        );
        assert_eq!((busy, lead, follow), (7, 2, 10));
    }

    #[tokio::test]
    async fn a_follower_whose_leader_is_not_polled_again_takes_the_gathering_over() {
        let gather = Reads::default();
        let mut busy = std::pin::pin!(gather.run(|| "a", WAIT, std::future::pending, |_| async { None }));
        assert!(futures::poll!(&mut busy).is_pending(), "under way");
        let mut lead = std::pin::pin!(gather.run(|| "b", WAIT, || async { 1 }, |_| async { Some(2) }));
        assert!(
            futures::poll!(&mut lead).is_pending(),
            "leads, yields, and is set aside"
        );
        let follower = gather.run(|| "c", WAIT, || async { 3 }, |_| async { Some(4) });
        let answer = tokio::time::timeout(std::time::Duration::from_secs(1), follower).await;
        assert_eq!(
            answer,
            Ok(3),
            "took the gathering over (nobody else in it: alone)"
        );
        assert_eq!(
            lead.await,
            1,
            "the leader, polled at last, finds its gathering gone"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_waits_for_its_answer_at_most_its_wait() {
        let gather = Reads::default();
        let mut busy = std::pin::pin!(gather.run(|| "a", WAIT, std::future::pending, |_| async { None }));
        assert!(futures::poll!(&mut busy).is_pending());
        // The leader closes, then never answers.
        let lead = gather.run(
            || "b",
            WAIT,
            std::future::pending,
            |followers| async move {
                let _unanswered = followers;
                std::future::pending().await
            },
        );
        let follower = gather.run(|| "c", WAIT, || async { 3 }, |_| async { None });
        let started = tokio::time::Instant::now();
        tokio::select! {
            biased;
            _ = lead => unreachable!("the leader never ends"),
            answer = follower => {
                assert_eq!(answer, 3, "read alone after the wait");
                assert_eq!(started.elapsed(), WAIT);
            }
        }
    }

    #[test]
    fn the_followers_of_other_parts_go_to_the_first_of_each_still_waiting() {
        let gather = Reads::default();
        let Turn::Lead(lead) = gather.join(|| "x1") else {
            panic!("the first leads")
        };
        let mut waiting: Vec<_> = ["y1", "x2", "y2", "z1", "z2", "z3"]
            .into_iter()
            .map(|q| match gather.join(|| q) {
                Turn::Follow(w) => w,
                _ => panic!("{q} follows"),
            })
            .collect();
        // z1 stopped waiting: z2 leads z's part.
        drop(waiting.remove(3));
        let followers = lead.close();
        let parts: Vec<char> = followers.iter().map(|f| f.query.as_bytes()[0] as char).collect();
        let kept = keep_part(followers, parts, &'x');
        assert_eq!(kept.iter().map(|f| f.query).collect::<Vec<_>>(), ["x2"]);
        let heard: Vec<Option<Vec<&str>>> = waiting
            .iter_mut()
            .map(|w| match w.answer.try_recv() {
                Ok(Heard::Lead(group)) => Some(group.iter().map(|f| f.query).collect()),
                _ => None,
            })
            .collect();
        assert_eq!(
            heard,
            [Some(vec!["y2"]), None, None, Some(vec!["z3"]), None],
            "y1 leads y2, z2 leads z3, x2 stays with its leader"
        );
    }

    #[tokio::test]
    async fn a_follower_handed_a_part_leads_it_with_its_own_work() {
        let gather = Reads::default();
        let (done, finished) = oneshot::channel::<u32>();
        let lead_x = |followers: Vec<Follower<&'static str, u32>>| async move {
            let parts: Vec<bool> = followers.iter().map(|f| f.query.starts_with('x')).collect();
            for f in keep_part(followers, parts, &true) {
                f.answer(11);
            }
            Some(10)
        };
        let lead_y = |followers: Vec<Follower<&'static str, u32>>| async move {
            assert_eq!(followers.iter().map(|f| f.query).collect::<Vec<_>>(), ["y2"]);
            for f in followers {
                f.answer(21);
            }
            Some(20)
        };
        let (busy, x1, y1, x2, y2) = tokio::join!(
            gather.run(
                || "a",
                WAIT,
                move || async move { finished.await.unwrap() },
                |_| async { None }
            ),
            gather.run(|| "x1", WAIT, || async { 1 }, lead_x),
            gather.run(|| "y1", WAIT, || async { 2 }, lead_y),
            gather.run(|| "x2", WAIT, || async { 3 }, |_| async { None }),
            async {
                let answer = gather
                    .run(|| "y2", WAIT, || async { 4 }, |_| async { None })
                    .await;
                done.send(7).unwrap();
                answer
            },
        );
        assert_eq!((busy, x1, y1, x2, y2), (7, 10, 20, 11, 21));
    }

    #[test]
    fn distinct_items_keep_the_order_they_first_came_in() {
        let (distinct, at) = distinct(["b", "a", "b", "c", "a"]);
        assert_eq!(distinct, ["b", "a", "c"]);
        assert_eq!(at, [0, 1, 0, 2, 1]);
    }

    #[test]
    fn answers_spread_over_every_asker_and_a_missing_one_is_none() {
        let (distinct, at) = distinct(["b", "a", "b", "c", "a"]);
        let answers: Vec<String> = distinct.iter().map(|d| d.to_uppercase()).collect();
        assert_eq!(
            spread(answers, &at),
            [Some("B"), Some("A"), Some("B"), Some("C"), Some("A")].map(|a| a.map(str::to_owned))
        );
        assert_eq!(spread(vec![1], &[0, 1, 0]), [Some(1), None, Some(1)]);
    }

    #[test]
    fn a_full_gathering_sends_the_next_one_alone() {
        let gather = Reads::default();
        let _lead = gather.join(|| "k");
        let followers: Vec<_> = (1..MAX_GATHERED).map(|_| gather.join(|| "k")).collect();
        assert!(followers.iter().all(|t| matches!(t, Turn::Follow(_))));
        assert!(matches!(gather.join(|| "k"), Turn::Alone));
    }
}
