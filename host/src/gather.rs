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

/// One piece of work waiting to go out with a leader's: what it asks, and where its
/// answer goes.
pub(crate) struct Follower<Q, A> {
    pub(crate) query: Q,
    pub(crate) reply: oneshot::Sender<A>,
}

/// The work gathering now, if a leader is gathering.
pub(crate) struct Gather<Q, A> {
    open: Mutex<Option<Vec<Follower<Q, A>>>>,
    /// Pieces of work under way ([`run`](Gather::run)): one that finds none works alone
    /// at once, without the leader's yield.
    running: AtomicUsize,
}

impl<Q, A> Default for Gather<Q, A> {
    fn default() -> Self {
        Gather {
            open: Mutex::new(None),
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
    /// Wait for the leader's answer; if it is dropped unanswered, work alone.
    Follow(oneshot::Receiver<A>),
    /// The gathering is full: work alone.
    Alone,
}

impl<Q, A> Gather<Q, A> {
    /// Does one piece of work, gathered: as a follower, waits for the leader's answer;
    /// as the leader, yields once for the others to join, then hands them (never none)
    /// to `together`, which answers each and returns the leader's own answer, or `None`
    /// to let them go. Whatever is not done together is done `alone`.
    pub(crate) async fn run<Alone, Together>(
        &self,
        query: impl FnOnce() -> Q,
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
        match self.join(query) {
            Turn::Alone => alone().await,
            Turn::Follow(answer) => match answer.await {
                Ok(answer) => answer,
                Err(_) => alone().await,
            },
            Turn::Lead(lead) => {
                tokio::task::yield_now().await;
                let followers = lead.close();
                if followers.is_empty() {
                    return alone().await;
                }
                match together(followers).await {
                    Some(mine) => mine,
                    None => alone().await,
                }
            }
        }
    }

    /// Joins the gathering under way with `query`, or starts one.
    pub(crate) fn join(&self, query: impl FnOnce() -> Q) -> Turn<'_, Q, A> {
        let mut open = self.open.lock();
        match &mut *open {
            None => {
                *open = Some(Vec::new());
                Turn::Lead(Lead { gather: Some(self) })
            }
            Some(followers) if followers.len() + 1 < MAX_GATHERED => {
                let (reply, answer) = oneshot::channel();
                followers.push(Follower {
                    query: query(),
                    reply,
                });
                Turn::Follow(answer)
            }
            Some(_) => Turn::Alone,
        }
    }
}

/// The leader's hold on a gathering: closing it takes the followers; dropping it
/// unclosed lets them go (each works alone).
pub(crate) struct Lead<'a, Q, A> {
    /// `None` once closed. While a gathering is open it is this leader's alone.
    gather: Option<&'a Gather<Q, A>>,
}

impl<Q, A> Lead<'_, Q, A> {
    /// Ends the gathering: the work that joined it, in the order it came. The next
    /// comer starts another.
    pub(crate) fn close(mut self) -> Vec<Follower<Q, A>> {
        self.end()
    }

    fn end(&mut self) -> Vec<Follower<Q, A>> {
        self.gather
            .take()
            .and_then(|g| g.open.lock().take())
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

    #[test]
    fn the_first_comer_leads_and_the_next_ones_follow_until_it_closes() {
        let gather = Reads::default();
        let Turn::Lead(lead) = gather.join(|| "a") else {
            panic!("the first leads")
        };
        let Turn::Follow(mut answer) = gather.join(|| "b") else {
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
            f.reply.send(7).unwrap();
        }
        assert_eq!(answer.try_recv(), Ok(7));
    }

    #[test]
    fn a_leader_dropped_unanswered_lets_its_followers_go() {
        let gather = Reads::default();
        let lead = gather.join(|| "a");
        let Turn::Follow(mut answer) = gather.join(|| "b") else {
            panic!("the second follows")
        };
        drop(lead);
        assert!(
            answer.try_recv().is_err(),
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
        let Turn::Follow(mut answer) = gather.join(|| "c") else {
            panic!("follows the second")
        };
        assert!(
            matches!(answer.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
            "the first leader's end did not take the second's followers"
        );
    }

    #[tokio::test]
    async fn work_that_finds_nothing_else_under_way_goes_at_once_and_alone() {
        let gather = Reads::default();
        let answer = gather.run(|| "a", || async { 1 }, |_| async { Some(2) }).await;
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
                move || async move { finished.await.unwrap() },
                |_| async { None }
            ),
            gather.run(
                || "b",
                || async { 1 },
                |followers| async move {
                    assert_eq!(followers.len(), 1, "the third joined the second");
                    for f in followers {
                        f.reply.send(10).unwrap();
                    }
                    Some(2)
                }
            ),
            async {
                let answer = gather.run(|| "c", || async { 3 }, |_| async { None }).await;
                done.send(7).unwrap();
                answer
            },
        );
        assert_eq!((busy, lead, follow), (7, 2, 10));
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
