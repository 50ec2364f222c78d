//! `get`'s L2 reads gathered ([`gather`](crate::gather)): the reads of plain entries
//! (a `GET`) that miss L1 at about the same moment are named in one guest call, read in
//! one `MGET` and judged in one more guest call, each key once however many ask for
//! it. A key read with a `GETEX` or the touch script is read alone, as its store
//! gathers it: waiting on each other gains the reads that slide nothing.

use crate::Result;
use crate::gather::{Follower, Gather, distinct, keep_part, spread};
use crate::guest::policy::NextRead;

use super::Corral;
use super::read::{Looked, ReadHints};

/// The gathering of a cache's `get`s, and how each key they read lately is to be read
/// next, by key (known before the guest names its entry): only the plain ones gather.
pub(crate) struct Gets {
    reads: Gather<String, Result<Looked>>,
    hints: ReadHints,
}

impl Gets {
    /// For about `capacity` keys (as many as L1 holds); `floor_ms` as
    /// [`ReadHints::new`]'s.
    pub(crate) fn new(capacity: u64, floor_ms: u64) -> Self {
        Gets {
            reads: Gather::default(),
            hints: ReadHints::new(capacity, floor_ms),
        }
    }
}

impl Corral {
    /// `key`'s entry read at `now`, gathered with the other `get`s of the moment when
    /// the store is worth it and the key is read plainly. A batch that cannot be named
    /// (a bad key among them) lets each read alone, with its own error.
    pub(crate) async fn look_gathered(&self, key: &str, now: u64) -> Result<Looked> {
        let inner = &*self.inner;
        let Some(gets) = inner.gets.as_ref() else {
            return self.look_alone(key, now).await;
        };
        if !matches!(gets.hints.get(key), None | Some(NextRead::Get)) {
            return self.look_alone(key, now).await;
        }
        // A follower waits at most one store timeout, then reads alone: one command,
        // plus one (contract §9).
        gets.reads
            .run(
                || key.to_owned(),
                inner.flight.store_timeout,
                || self.look_alone(key, now),
                |followers| self.lead_gets(key, followers, now),
            )
            .await
    }

    /// `key`'s entry read at `now` on its own.
    async fn look_alone(&self, key: &str, now: u64) -> Result<Looked> {
        let entry = self.entry_of(key).await?;
        let looked = self.l2_look(&entry, now).await?;
        self.note_key_hint(key, &entry);
        Ok(Looked::Read(Box::new(looked), None))
    }

    /// Carries the way `entry` is to be read next over to its key.
    fn note_key_hint(&self, key: &str, entry: &str) {
        let inner = &*self.inner;
        if let Some(gets) = &inner.gets {
            let next = inner.read_hints.get(entry).unwrap_or(NextRead::Get);
            gets.hints.note(key, gets.hints.get(key), next);
        }
    }

    /// Names `key` and the followers' keys, reads them together (on a store in parts,
    /// those of `key`'s part), and answers each follower; the leader's own answer, or
    /// `None` when the batch could not be named (the followers, let go, each read alone).
    async fn lead_gets(
        &self,
        key: &str,
        followers: Vec<Follower<String, Result<Looked>>>,
        now: u64,
    ) -> Option<Result<Looked>> {
        let mut followers = followers;
        let (keys, at, names) = loop {
            // A key asked for twice is read once.
            let (keys, at) = distinct(std::iter::once(key).chain(followers.iter().map(|f| f.query.as_str())));
            let names = self.entries_of(&keys).await.ok()?;
            // A store in parts (a cluster's masters) reads the keys of each part in a
            // request of their own: the leader keeps those of its key's part and hands
            // each other part's to one of its followers, so that none waits on another
            // part's reply. The kept keys are named again: a lookup of names just made.
            let entries = &self.inner.stores.entries;
            if entries.in_parts() {
                let mine = entries.part_of(names.get(0));
                let parts: Vec<_> = at[1..].iter().map(|&i| entries.part_of(names.get(i))).collect();
                if parts.iter().any(|part| *part != mine) {
                    followers = keep_part(followers, parts, &mine);
                    continue;
                }
            }
            break (keys, at, names);
        };
        // Judged no earlier than now: a follower may have called after the leader.
        let now = now.max(self.inner.clock.now_ms());
        let reading: Vec<&str> = names.iter().collect();
        // Kept judgements are placed by the keys' hashes, as a batch places them.
        let hashes: Vec<u64> = keys.iter().map(|key| self.inner.names.hash(key)).collect();
        let looks = self.l2_look_each(&reading, &hashes, now).await;
        for (key, entry) in keys.iter().zip(names.iter()) {
            self.note_key_hint(key, entry);
        }
        let mut answers = spread(looks, &at).into_iter().map(|answer| {
            answer.unwrap_or_else(|| {
                Err(crate::Error::guest(
                    "a gathered read went unanswered",
                    "broken contract",
                ))
            })
        });
        let mine = answers.next();
        for (follower, answer) in followers.into_iter().zip(answers) {
            follower.answer(answer);
        }
        mine
    }
}
