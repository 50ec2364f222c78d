//! `get`'s L2 reads gathered ([`gather`](crate::gather)): the reads of plain entries
//! (a `GET`) that miss L1 at about the same moment are named in one guest call, read in
//! one `MGET` and judged in one more guest call, each key once however many ask for
//! it. A key read with a `GETEX` or the touch script is read alone, as its store
//! gathers it: waiting on each other gains the reads that slide nothing.

use std::collections::HashMap;

use crate::Result;
use crate::gather::{Follower, Gather};
use crate::guest::policy::NextRead;

use super::Corral;
use super::read::Looked;

/// The gathering of a cache's `get`s: each asks with its key.
pub(crate) type Gets = Gather<String, Result<Looked>>;

impl Corral {
    /// `key`'s entry read at `now`, gathered with the other `get`s of the moment when
    /// the store is worth it and the key is read plainly. A batch that cannot be named
    /// (a bad key among them) lets each read alone, with its own error.
    pub(crate) async fn look_gathered(&self, key: &str, now: u64) -> Result<Looked> {
        let inner = &*self.inner;
        let Some(gets) = inner.gets.as_ref().filter(|_| {
            // Keyed by the key, not the entry's name: known before the guest names it.
            matches!(inner.key_hints.get(key), None | Some(NextRead::Get))
        }) else {
            return self.look_alone(key, now).await;
        };
        // A follower waits at most one store timeout, then reads alone: one command,
        // plus one (contract §D).
        gets.run(
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
        Ok((looked, None))
    }

    /// Carries the way `entry` is to be read next over to its key.
    fn note_key_hint(&self, key: &str, entry: &str) {
        let inner = &*self.inner;
        let next = inner.read_hints.get(entry).unwrap_or(NextRead::Get);
        inner.key_hints.note(key, inner.key_hints.get(key), next);
    }

    /// Names `key` and the followers' keys, reads them together, and answers each
    /// follower; the leader's own answer, or `None` when the batch could not be named
    /// (the followers, let go, each read alone).
    async fn lead_gets(
        &self,
        key: &str,
        followers: Vec<Follower<String, Result<Looked>>>,
        now: u64,
    ) -> Option<Result<Looked>> {
        // A key asked for twice is read once: every asker called before the read is
        // sent, so its answer is as good as a read of its own.
        let mut keys = vec![key.to_owned()];
        let mut seen = HashMap::from([(key, 0)]);
        let at: Vec<usize> = followers
            .iter()
            .map(|f| {
                *seen.entry(f.query.as_str()).or_insert_with(|| {
                    keys.push(f.query.clone());
                    keys.len() - 1
                })
            })
            .collect();
        // Named as `get` alone names them: checked first, then in the generation known or
        // read (never a fallback one), so that a read after a clear misses.
        let policy = &self.inner.policy;
        let prefix = &self.inner.prefix;
        let generation = match self.known_generation() {
            Some(g) => g,
            None => {
                policy.locate_entries(prefix, &keys, 0).ok()?;
                self.generation().await.ok()?
            }
        };
        let names = policy.locate_entries(prefix, &keys, generation).ok()?;
        // Judged no earlier than now: a follower may have called after the leader.
        let now = now.max(self.inner.clock.now_ms());
        let reading: Vec<&str> = names.iter().map(String::as_str).collect();
        let looks = self.l2_look_many(&reading, now).await;
        for (key, entry) in keys.iter().zip(&names) {
            self.note_key_hint(key, entry);
        }
        let answer = |i: usize| {
            looks.get(i).cloned().unwrap_or_else(|| {
                Err(crate::Error::guest(
                    "a gathered read went unanswered",
                    "broken contract",
                ))
            })
        };
        for (follower, i) in followers.into_iter().zip(at) {
            // A follower that stopped waiting needs no answer.
            let _ = follower.reply.send(answer(i));
        }
        Some(answer(0))
    }
}
