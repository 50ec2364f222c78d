//! Many keys at once, decided and driven inside the component (contract §5.16):
//! [`PortableCache::get_or_set_many`] over the component's `begin-many`.
//!
//! One call of an instance runs the whole batch: `begin-many` answers every key (a hit,
//! a load this call leads, or a wait); the loader is called with every led key (in
//! calls of at most `max_batch` keys, as the guest's `batch-calls` splits them, one
//! after the other), each load ended with what it gave; then each wait is asked, after
//! the loads, so a flight another process holds is awaited only once this call's own
//! locks are gone. A wait that comes to lead its key (the flight it followed came to
//! nothing) is loaded in a loader call of its own.

use std::collections::HashMap;

use bytes::Bytes;
use wasmtime::component::ResourceAny;

use super::{PortableCache, PortableState, ShouldCache, Slot, run_origin};
use crate::LoadOptions;
use crate::Result;
use crate::cache::distinct_keys;
use crate::error::Absent;
use crate::guest::bindings::corral::cache::types;
use crate::guest::bindings::exports::corral::cache::cache::{Begun, Followed};
use crate::guest::convert::{from_wit, options_in};

/// The caller's origin for a batch: the keys to load give their values (a key left out
/// is that key's loader failure), or one failure for them all; and the verdict on
/// caching each value.
struct BatchOrigin {
    loader: BatchLoader,
    should_cache: ShouldCache,
    /// The most keys one loader call gets (`None`: no limit).
    max_batch: Option<u64>,
}

/// The values of the keys asked, or the failure of them all.
type Loaded = std::result::Result<Vec<(String, Vec<u8>)>, String>;
/// The loader of one portable batch.
type BatchLoader = Box<dyn FnMut(&[String]) -> Loaded + Send>;

/// One key's answer, as the component gives it.
type Answer = std::result::Result<Vec<u8>, types::Error>;

/// A load the call holds: the key's position, the `load` resource, and whether its
/// outcome is the key's answer (an eager refresh's is not: the key was served already).
type Held = (usize, ResourceAny, bool);

impl PortableCache {
    /// As [`Corral::get_or_set_many`](crate::Corral::get_or_set_many), decided and
    /// driven inside the component: an answer per key, in order. `loader` is called
    /// with every key this call leads when the batch begins (in this process and, by
    /// the keys' flight locks, across processes; at most `max_batch` keys per call, the
    /// calls one after the other), and once more for each key it
    /// comes to lead later (a key another process was loading that came to nothing, a
    /// leader in this process gone); a key it leaves out is absent (`Ok(None)`, nothing
    /// cached), and its failure is the failure of every key it was asked for.
    ///
    /// `options` are the native batch's: the entry's expiry, `tags`, `should_cache`,
    /// `bypass` and `max_batch` (at most that many keys per loader call). The portable
    /// body's timeouts and eager refresh are the cache's own
    /// ([`PortableBuilder`](super::PortableBuilder)): one call's hard or soft timeout,
    /// eager refresh or background completion is refused. A loader panic fails the
    /// whole call (the caller gets the panic), as it traps any portable call.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the
    /// option it cannot keep, `max_batch`, `key` (with its position among the distinct
    /// keys), an entry option or `tags`, before anything runs; per key, the errors of
    /// [`get_or_set`](Self::get_or_set).
    pub async fn get_or_set_many(
        &self,
        keys: &[impl AsRef<str>],
        options: impl Into<LoadOptions>,
        loader: impl FnMut(&[String]) -> Loaded + Send + 'static,
    ) -> Result<Vec<Result<Option<Bytes>>>> {
        let options: LoadOptions = options.into();
        refuse_timeouts(&options)?;
        let max_batch = options.max_batch.map(|n| n as u64);
        // Each key once in the component (`begin-many` takes each key once).
        let hasher = foldhash::fast::RandomState::default();
        let (keys, _, asked) = distinct_keys(keys, |key| std::hash::BuildHasher::hash_one(&hasher, key));
        let keys: Vec<String> = keys.into_iter().map(str::to_owned).collect();
        let tags: Vec<String> = options.tags.to_vec();
        let (entry, bypass) = (options_in(&options.entry), options.bypass);
        let mut origin = BatchOrigin {
            loader: Box::new(loader),
            should_cache: Box::new(move |value: &[u8]| options.accepts(value)),
            max_batch,
        };
        let answers = self
            .call(move |s| {
                if let Some(max) = max_batch {
                    let checked = s
                        .guest
                        .corral_cache_policy()
                        .call_check_max_batch(&mut s.store, max)?;
                    if let Err(e) = checked {
                        return Ok(Err(e));
                    }
                }
                let begun = s.guest.corral_cache_cache().call_begin_many(
                    &mut s.store,
                    &keys,
                    entry,
                    bypass,
                    &tags,
                )?;
                match begun {
                    Err(e) => Ok(Err(e)),
                    Ok(begun) => origin.run(s, &keys, begun).map(Ok),
                }
            })
            .await?;
        let absent = Absent.to_string();
        let answers: Vec<Result<Option<Bytes>>> = answers
            .into_iter()
            .map(|answer| match answer {
                Ok(value) => Ok(Some(Bytes::from(value))),
                Err(types::Error::LoaderFailed(reason)) if reason == absent => Ok(None),
                Err(e) => Err(from_wit(e)),
            })
            .collect();
        Ok(asked.into_iter().map(|i| answers[i].clone()).collect())
    }
}

impl BatchOrigin {
    /// Answers every key of a begun batch: the hits at once, the loads with one loader
    /// call, then the waits.
    fn run(
        &mut self,
        s: &mut Slot<PortableState>,
        keys: &[String],
        begun: Vec<std::result::Result<Begun, types::Error>>,
    ) -> wasmtime::Result<Vec<Answer>> {
        let mut answers: Vec<Option<Answer>> = keys.iter().map(|_| None).collect();
        let mut loads = Vec::new();
        let mut waits = Vec::new();
        for (at, begun) in begun.into_iter().enumerate() {
            match begun {
                Err(e) => answers[at] = Some(Err(e)),
                Ok(Begun::Hit(value)) => answers[at] = Some(Ok(value)),
                Ok(Begun::Lead(load)) => loads.push((at, load, true)),
                Ok(Begun::Refresh((value, load))) => {
                    answers[at] = Some(Ok(value));
                    loads.push((at, load, false));
                }
                Ok(Begun::Wait(follower)) => waits.push((at, follower)),
            }
        }
        let mut waits = waits.into_iter();
        // A call that ends early (the caller gone, a panic) drops the waits not asked.
        let loaded = self.load(s, keys, loads);
        for (at, answer) in loaded.inspect_err(|_| drop_all(s, &mut waits))? {
            answers[at] = Some(answer);
        }
        while let Some((at, follower)) = waits.next() {
            let answer = self.follow(s, &keys[at], follower);
            answers[at] = Some(answer.inspect_err(|_| drop_all(s, &mut waits))?);
        }
        Ok(answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| Err(lost())))
            .collect())
    }

    /// Calls the loader once for every load held, and ends each with what it gave;
    /// the answers of the loads whose outcome is their key's.
    fn load(
        &mut self,
        s: &mut Slot<PortableState>,
        keys: &[String],
        loads: Vec<Held>,
    ) -> wasmtime::Result<Vec<(usize, Answer)>> {
        if loads.is_empty() {
            return Ok(Vec::new());
        }
        let sizes = s.guest.corral_cache_policy().call_batch_calls(
            &mut s.store,
            loads.len() as u64,
            self.max_batch,
        )?;
        let (mut answers, mut sizes) = (Vec::with_capacity(loads.len()), sizes.into_iter());
        let mut loads = loads.into_iter();
        while loads.len() > 0 {
            // Should the guest's sizes fall short, the rest is one more call.
            let size = sizes
                .next()
                .map_or(loads.len(), |n| usize::try_from(n).unwrap_or(usize::MAX).max(1));
            let call: Vec<Held> = loads.by_ref().take(size).collect();
            match self.load_once(s, keys, call) {
                Ok(answered) => answers.extend(answered),
                Err(e) => {
                    for (_, load, _) in loads {
                        let _ = load.resource_drop(&mut s.store);
                    }
                    return Err(e);
                }
            }
        }
        Ok(answers)
    }

    /// One loader call for the `loads` given, each load ended with what it gave.
    fn load_once(
        &mut self,
        s: &mut Slot<PortableState>,
        keys: &[String],
        loads: Vec<Held>,
    ) -> wasmtime::Result<Vec<(usize, Answer)>> {
        let asked: Vec<String> = loads.iter().map(|(at, ..)| keys[*at].clone()).collect();
        // The call's keys count their timeouts from now, not from the batch's start.
        let load = s.guest.corral_cache_cache().load();
        for (_, held, _) in &loads {
            if let Err(e) = load.call_begin(&mut s.store, *held) {
                drop_all(s, loads.into_iter().map(|(at, held, _)| (at, held)));
                return Err(e);
            }
        }
        // `should_cache` runs with the loader: its panic is the call's, as the loader's is.
        let (loader, should_cache) = (&mut self.loader, &self.should_cache);
        let judged = || {
            (loader)(&asked).map(|values| {
                let judge = |(key, value): (String, Vec<u8>)| {
                    let cacheable = should_cache(&value);
                    (key, (value, cacheable))
                };
                values.into_iter().map(judge).collect::<Vec<_>>()
            })
        };
        let out = match run_origin(s, judged) {
            Ok(out) => out,
            Err(e) => {
                for (_, load, _) in loads {
                    load.resource_drop(&mut s.store)?;
                }
                return Err(e);
            }
        };
        let (mut values, failure): (HashMap<String, (Vec<u8>, bool)>, _) = match out {
            Ok(values) => (values.into_iter().collect(), None),
            Err(reason) => (HashMap::new(), Some(reason)),
        };
        let cache = s.guest.corral_cache_cache().load();
        let absent = Absent.to_string();
        let mut answers = Vec::with_capacity(loads.len());
        for (at, load, answers_key) in loads {
            let answer = match (&failure, values.remove(&keys[at])) {
                (Some(reason), _) => cache.call_fail(&mut s.store, load, reason)?,
                (None, Some((value, cacheable))) => {
                    cache.call_complete(&mut s.store, load, &value, cacheable)?
                }
                // Absent: a loader failure to the flight (fail-safe may serve a stale
                // copy), `None` to its callers.
                (None, None) => cache.call_fail(&mut s.store, load, &absent)?,
            };
            if answers_key {
                answers.push((at, answer));
            }
        }
        Ok(answers)
    }

    /// Asks a waiting key's follower for its outcome; when the flight it followed went
    /// away, this call leads the key and loads it alone.
    fn follow(
        &mut self,
        s: &mut Slot<PortableState>,
        key: &str,
        follower: ResourceAny,
    ) -> wasmtime::Result<Answer> {
        let outcome = s
            .guest
            .corral_cache_cache()
            .follower()
            .call_outcome(&mut s.store, follower);
        follower.resource_drop(&mut s.store)?;
        match outcome? {
            Followed::Ready(answer) => Ok(answer),
            Followed::Lead(load) => {
                let keys = [key.to_owned()];
                let mut loaded = self.load(s, &keys, vec![(0, load, true)])?;
                Ok(loaded.pop().map_or_else(|| Err(lost()), |(_, answer)| answer))
            }
            // Each key of a batch comes once: no load of this call's instance is ahead.
            Followed::Pending => Err(wasmtime::format_err!(
                "the component made a batch's key wait on its own instance"
            )),
        }
    }
}

/// Drops the followers or loads left (their resources go with the instance if a drop
/// fails).
fn drop_all(s: &mut Slot<PortableState>, left: impl Iterator<Item = (usize, ResourceAny)>) {
    for (_, resource) in left {
        let _ = resource.resource_drop(&mut s.store);
    }
}

/// Refuses the options the portable body cannot keep (it has no loader timeouts), as
/// the native batch refuses those that need `fetch`.
pub(super) fn refuse_timeouts(options: &LoadOptions) -> Result<()> {
    options.refuse_outliving(
        true,
        "the portable body takes timeouts and eager refresh from its builder, not per call",
    )
}

fn lost() -> types::Error {
    types::Error::Other("the batch lost a key's load".to_string())
}
