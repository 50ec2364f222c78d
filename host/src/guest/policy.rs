//! [`Policy`]: the handle every body asks for the contract's decisions.
//!
//! Calls are synchronous and short; each takes an idle instance from a small pool (one
//! `Store` each), so concurrent callers never share a `Store`. A trapped instance is
//! dropped, never reused.

// Without the `redis` feature some of what serves Redis stores goes unused.
#![cfg_attr(not(feature = "redis"), allow(dead_code, unused_variables))]

use std::cell::RefCell;
use std::fmt;
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use super::bindings::corral::cache::types;
use super::bindings::exports::corral::cache::policy as wit;
use super::convert::{Parts, from_wit, joined, meta_out, options_in, split};
use super::engine::{CALL_BUDGET_TICKS, Loaded, PolicyState, Slot, instantiate, loaded, trap};
use crate::Result;
use crate::hint::prefetch;
use crate::options::{EntryMeta, EntryOptions};

/// How many idle instances the pool keeps; more are created under load and dropped after.
const MAX_IDLE: usize = 64;

/// The settings every body starts from, as the guest states them (contract §5.9): read
/// once per process, never written anywhere else.
pub(crate) fn defaults() -> Result<Settings> {
    static DEFAULTS: OnceLock<Settings> = OnceLock::new();
    if let Some(d) = DEFAULTS.get() {
        return Ok(*d);
    }
    let loaded = loaded()?;
    let mut slot = instantiate(loaded, &loaded.policy_pre, PolicyState::new())?;
    let d = slot
        .guest
        .corral_cache_policy()
        .call_defaults(&mut slot.store)
        .map_err(trap)?;
    Ok(*DEFAULTS.get_or_init(|| d))
}

/// Checks settings with the guest (limits, the eager refresh fraction).
/// The schedule of background tries the settings give.
pub(crate) fn retry(settings: &Settings) -> crate::store::Retry {
    crate::store::Retry {
        first: std::time::Duration::from_millis(settings.retry_first_ms),
        max: std::time::Duration::from_millis(settings.retry_max_ms),
    }
}

pub(crate) fn check_settings(settings: Settings) -> Result<()> {
    let loaded = loaded()?;
    let mut slot = instantiate(loaded, &loaded.policy_pre, PolicyState::new())?;
    slot.guest
        .corral_cache_policy()
        .call_check_settings(&mut slot.store, settings)
        .map_err(trap)?
        .map_err(from_wit)
}

/// A handle to the guest's cache decisions. Cheap to clone.
#[derive(Clone)]
pub struct Policy {
    inner: Arc<Inner>,
}

struct Inner {
    loaded: &'static Loaded,
    // Boxed on purpose: a slot moves out of the pool and back around every call.
    #[allow(clippy::vec_box)]
    slots: Mutex<Vec<Box<Slot<PolicyState>>>>,
    /// Instances this handle had to create (for diagnostics: they are recycled).
    created: std::sync::atomic::AtomicU64,
    limits: types::Limits,
    header_len: usize,
    /// How many leading bytes of each read `read-many` needs (`batch-head-len`).
    batch_head_len: usize,
    scripts: crate::store::Scripts,
    lock_scripts: wlock::LockScripts,
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

/// The limits of one cache (see the builder).
pub(crate) use types::{Limits, Settings};

pub(crate) use super::bindings::corral::lock::types::Held;
pub(crate) use super::bindings::exports::corral::cache::flight as wflight;
pub(crate) use super::bindings::exports::corral::lock::policy as wlock;
pub(crate) use types::EntryMeta as WitMeta;
pub(crate) use types::Tagged;
pub(crate) use wit::{
    ExpirePlan, GenerationFound, GenerationHeeded, GenerationNews, Heard, JudgedMany, JudgedRead, KeptTag,
    KnownGeneration, NextRead, Plan, ReadOutcome, StoreNames, TagHeeded, TagMessage, TagMoments, TagNews,
    TagRead, TagVerdict, Touch, Verdict,
};

impl Policy {
    /// Loads the guest and checks `limits` with it.
    pub(crate) fn load(limits: Limits) -> Result<Self> {
        let loaded = loaded()?;
        let mut slot = instantiate(loaded, &loaded.policy_pre, PolicyState::new())?;
        let p = slot.guest.corral_cache_policy();
        let checked = p.call_check_limits(&mut slot.store, limits).map_err(trap)?;
        checked.map_err(from_wit)?;
        let header_len = p.call_header_len(&mut slot.store).map_err(trap)? as usize;
        let batch_head_len = p.call_batch_head_len(&mut slot.store).map_err(trap)? as usize;
        let read_script = p.call_redis_read_script(&mut slot.store).map_err(trap)?;
        let delete_if_equal_script = p
            .call_redis_delete_if_equal_script(&mut slot.store)
            .map_err(trap)?;
        let lock_and_peek_script = p.call_redis_lock_and_peek_script(&mut slot.store).map_err(trap)?;
        let fill_and_release_script = p
            .call_redis_fill_and_release_script(&mut slot.store)
            .map_err(trap)?;
        let renew_fenced_script = p.call_redis_renew_fenced_script(&mut slot.store).map_err(trap)?;
        let replace_if_equal_script = p
            .call_redis_replace_if_equal_script(&mut slot.store)
            .map_err(trap)?;
        let grace_ms = p.call_store_ttl_grace_ms(&mut slot.store).map_err(trap)?;
        let lock_scripts = slot
            .guest
            .corral_lock_policy()
            .call_scripts(&mut slot.store)
            .map_err(trap)?;
        Ok(Policy {
            inner: Arc::new(Inner {
                loaded,
                slots: Mutex::new(vec![slot]),
                created: std::sync::atomic::AtomicU64::new(1),
                limits,
                header_len,
                batch_head_len,
                scripts: crate::store::Scripts {
                    read_and_touch: read_script,
                    delete_if_equal: delete_if_equal_script,
                    lock_and_peek: lock_and_peek_script,
                    fill_and_release: fill_and_release_script,
                    replace_if_equal: replace_if_equal_script,
                    renew_fenced: renew_fenced_script,
                    grace_ms,
                },
                lock_scripts,
            }),
        })
    }

    fn call<R>(&self, f: impl FnOnce(&mut Slot<PolicyState>) -> wasmtime::Result<R>) -> Result<R> {
        self.call_with_budget(CALL_BUDGET_TICKS, f)
    }

    fn call_with_budget<R>(
        &self,
        ticks: u64,
        f: impl FnOnce(&mut Slot<PolicyState>) -> wasmtime::Result<R>,
    ) -> Result<R> {
        // Every policy instance is stateless, so any serves any handle: the calling
        // thread keeps one of its own (no lock on the hot path), and the pool serves the
        // rare call that finds it busy.
        thread_local! {
            static LOCAL: RefCell<Option<Box<Slot<PolicyState>>>> = const { RefCell::new(None) };
        }
        let local = LOCAL.with(|l| l.try_borrow_mut().ok().and_then(|mut l| l.take()));
        let mut slot = match local.or_else(|| self.inner.slots.lock().pop()) {
            Some(slot) => slot,
            None => {
                self.inner
                    .created
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                instantiate(
                    self.inner.loaded,
                    &self.inner.loaded.policy_pre,
                    PolicyState::new(),
                )?
            }
        };
        slot.store.set_epoch_deadline(ticks);
        // A trapped instance is poisoned: it is dropped, not returned.
        let out = f(&mut slot).map_err(trap)?;
        let slot = LOCAL.with(|l| match l.try_borrow_mut() {
            Ok(mut l) if l.is_none() => {
                *l = Some(slot);
                None
            }
            _ => Some(slot),
        });
        if let Some(slot) = slot {
            let mut slots = self.inner.slots.lock();
            if slots.len() < MAX_IDLE {
                slots.push(slot);
            }
        }
        Ok(out)
    }

    /// Checks a key against the contract (non-empty, not only white space, within the
    /// length limit).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `key`.
    pub fn validate_key(&self, key: &str) -> Result<()> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_validate_key(&mut s.store, key, limits)
        })?
        .map_err(from_wit)
    }

    /// Checks `meta` at `now_ms`, applying a read's sliding touch. For tests that
    /// compare a store's own judgement with the guest's.
    ///
    /// # Errors
    /// [`ErrorKind::Guest`](crate::ErrorKind::Guest) if the component fails.
    #[cfg(any(test, feature = "test-util"))]
    pub fn check(&self, meta: &EntryMeta, now_ms: u64) -> Result<Freshness> {
        let meta = super::convert::meta_in(meta);
        let f = self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_check(&mut s.store, meta, now_ms)
        })?;
        use crate::guest::bindings::exports::corral::cache::policy::Freshness as WitFreshness;
        Ok(match f {
            WitFreshness::Fresh((meta, moved)) => Freshness::Fresh {
                meta: meta_out(meta),
                moved,
            },
            WitFreshness::Stale => Freshness::Stale,
            WitFreshness::Expired => Freshness::Expired,
        })
    }

    /// Soft invalidation of stored bytes at `now_ms` (contract §7.4).
    pub(crate) fn expire(&self, stored: &[u8], now_ms: u64) -> Result<ExpirePlan> {
        let limits = self.inner.limits;
        let head = &stored[..stored.len().min(self.inner.header_len)];
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_expire(&mut s.store, head, stored.len() as u64, now_ms, limits)
        })
    }

    pub(crate) fn plan_set(
        &self,
        key: &str,
        value_len: usize,
        options: &EntryOptions,
        now_ms: u64,
    ) -> Result<Plan> {
        let limits = self.inner.limits;
        let options = options_in(options);
        self.call(|s| {
            s.guest.corral_cache_policy().call_plan_set(
                &mut s.store,
                key,
                value_len as u64,
                options,
                now_ms,
                limits,
            )
        })?
        .map_err(from_wit)
    }

    /// Reads stored bytes at `now_ms`: fresh (with the touch to write back), expired,
    /// removed or corrupt. `slid_ms` is the TTL the read set, if it was a `GETEX`.
    pub(crate) fn read(&self, stored: &[u8], now_ms: u64, slid_ms: Option<u64>) -> Result<ReadOutcome> {
        let limits = self.inner.limits;
        let head = &stored[..stored.len().min(self.inner.header_len)];
        self.call(|s| {
            s.guest.corral_cache_policy().call_read(
                &mut s.store,
                head,
                stored.len() as u64,
                now_ms,
                limits,
                slid_ms,
            )
        })
    }

    /// Checks `key` and names its data in a shared store under `prefix` (contract §2.4).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `key`.
    pub(crate) fn locate(&self, prefix: &str, key: &str, generation: u64) -> Result<StoreNames> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_locate(&mut s.store, prefix, key, generation, limits)
        })?
        .map_err(from_wit)
    }

    /// Checks every key of a batch and names its entry under `prefix`, in order, in
    /// one call (contract §5.16).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `key`,
    /// saying the bad key's position.
    pub(crate) fn locate_entries<K: AsRef<str>>(
        &self,
        prefix: &str,
        keys: &[K],
        generation: u64,
    ) -> Result<Parts> {
        let limits = self.inner.limits;
        let keys = joined(keys);
        let names = self
            .call(|s| {
                s.guest.corral_cache_policy().call_locate_entries(
                    &mut s.store,
                    prefix,
                    &keys,
                    generation,
                    limits,
                )
            })?
            // The error says the position already (contract §5.16).
            .map_err(|(_, e)| from_wit(e))?;
        split(names)
            .filter(|split| split.len() == keys.ends.len())
            .ok_or_else(|| crate::Error::guest("a batch's names did not split", "broken contract"))
    }

    /// Judges a batch's plain first reads (the bytes each `GET` found) at `now_ms`, in
    /// one call (contract §5.16): each served from its read alone, or flying on with its
    /// outcome (and for a fresh entry, how long L1 may serve it).
    pub(crate) fn read_many<'r>(
        &self,
        reads: impl Iterator<Item = &'r [u8]> + Clone,
        now_ms: u64,
        l1_ttl_ms: u64,
    ) -> Result<JudgedMany> {
        let limits = self.inner.limits;
        let head_len = self.inner.batch_head_len;
        let head = |stored: &[u8]| stored.len().min(head_len);
        // The heads joined in one buffer, the lengths in a list of their own: one copy
        // each across the boundary, not one per read.
        // Counted as each head is asked of the CPU's cache: written on another core
        // (the connection's), the reads' bytes are copied below with their misses met
        // together.
        let (count, sum) = reads.clone().fold((0, 0), |(n, sum), r| {
            prefetch(r, head(r));
            (n + 1, sum + head(r))
        });
        let mut heads = Vec::with_capacity(sum);
        let mut lens = Vec::with_capacity(count);
        for stored in reads {
            heads.extend_from_slice(&stored[..head(stored)]);
            lens.push(stored.len() as u64);
        }
        self.call(|s| {
            s.guest.corral_cache_policy().call_read_many(
                &mut s.store,
                &heads,
                &lens,
                now_ms,
                limits,
                l1_ttl_ms,
            )
        })
    }

    /// Checks a batch's `max_batch`.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming `max_batch`.
    pub(crate) fn check_max_batch(&self, max_batch: u64) -> Result<()> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_check_max_batch(&mut s.store, max_batch)
        })?
        .map_err(from_wit)
    }

    /// How keys that reached their loads together split into loader calls: the calls'
    /// sizes, in order.
    pub(crate) fn batch_calls(&self, ready: u64, max_batch: Option<u64>) -> Result<Vec<u64>> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_batch_calls(&mut s.store, ready, max_batch)
        })
    }

    /// What a removal writes (a tombstone carrying `nonce`) and its store TTL.
    pub(crate) fn removal(&self, lock_ttl_ms: u64, nonce: &[u8]) -> Result<(Vec<u8>, u64)> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_removal(&mut s.store, lock_ttl_ms, nonce)
        })
    }

    /// How long, in real time, a get-or-set's store steps may take under `settings`
    /// (contract §5.13).
    pub(crate) fn store_budget(&self, settings: Settings) -> Result<types::StoreBudget> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_store_budget_for(&mut s.store, settings)
        })
    }

    /// How long a tagged load may read its tags' moments before its loader runs.
    pub(crate) fn tag_read_ms(
        &self,
        budget: types::StoreBudget,
        left_ms: u64,
        first_mark_in_ms: Option<u64>,
    ) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_tag_read_ms(&mut s.store, budget, left_ms, first_mark_in_ms)
        })
    }

    /// Checks `key` and names its entry under `prefix` (one name, not four).
    pub(crate) fn locate_entry(&self, prefix: &str, key: &str, generation: u64) -> Result<String> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_locate_entry(&mut s.store, prefix, key, generation, limits)
        })?
        .map_err(from_wit)
    }

    /// Checks an entry's tags (contract §7.5): an argument error naming `tags`.
    pub(crate) fn check_tags(&self, tags: &[String]) -> Result<()> {
        self.call(|s| s.guest.corral_cache_policy().call_check_tags(&mut s.store, tags))?
            .map_err(from_wit)
    }

    /// A tagged write's header and store TTL.
    pub(crate) fn tag_plan(
        &self,
        header: &[u8],
        store_ttl_ms: u64,
        tagged: &Tagged,
        now_ms: u64,
    ) -> Result<(Vec<u8>, u64)> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest.corral_cache_policy().call_tag_plan(
                &mut s.store,
                header,
                store_ttl_ms,
                tagged,
                now_ms,
                limits,
            )
        })?
        .map_err(from_wit)
    }

    /// The moment a tagged set is stamped with, after the invalidations it knows of.
    pub(crate) fn tag_written_at(&self, now_ms: u64, known: &[TagMoments]) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_tag_written_at(&mut s.store, now_ms, known)
        })
    }

    /// What a tagged entry's tags' moments say about it.
    pub(crate) fn judge_tags(
        &self,
        tagged: &Tagged,
        meta: WitMeta,
        moments: &[TagMoments],
        stored: bool,
        now_ms: u64,
    ) -> Result<TagVerdict> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_judge_tags(&mut s.store, tagged, meta, moments, stored, now_ms)
        })
    }

    /// What a tagged entry `judge_tags` found hidden is, judged again by the store's own
    /// moments (`found`, each read heard as `heeded`), and until when L1 may keep it.
    pub(crate) fn judge_tags_again(
        &self,
        tagged: &Tagged,
        meta: WitMeta,
        found: &[TagMoments],
        heeded: &[TagHeeded],
        now_ms: u64,
    ) -> Result<(TagVerdict, u64)> {
        self.call(|s| {
            s.guest.corral_cache_policy().call_judge_tags_again(
                &mut s.store,
                tagged,
                meta,
                found,
                heeded,
                now_ms,
            )
        })
    }

    /// The moments a tag key holds.
    pub(crate) fn tag_moments_of(&self, stored: Option<&[u8]>) -> Result<TagMoments> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_tag_moments_of(&mut s.store, stored)
        })
    }

    /// What an invalidation writes over a tag key holding `stored`.
    pub(crate) fn tag_update(
        &self,
        stored: Option<&[u8]>,
        remove: bool,
        now_ms: u64,
    ) -> Result<(TagMoments, Vec<u8>)> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_tag_update(&mut s.store, stored, remove, now_ms)
        })
    }

    /// Whether a wall clock read at `now_ms`, after `latest_ms`, stepped back.
    pub(crate) fn clock_stepped_back(&self, latest_ms: u64, now_ms: u64) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_clock_stepped_back(&mut s.store, latest_ms, now_ms)
        })
    }

    /// Until when moments read at `now_ms` may be kept.
    pub(crate) fn tag_known_until(&self, now_ms: u64, l1_ttl_ms: u64) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_tag_known_until(&mut s.store, now_ms, l1_ttl_ms)
        })
    }

    /// The store TTL of a tag key or a generation counter.
    pub(crate) fn tag_state_ttl(&self, now_ms: u64) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_tag_state_ttl(&mut s.store, now_ms)
        })
    }

    /// Where `tag`'s moments live under `prefix`.
    pub(crate) fn locate_tag(&self, prefix: &str, tag: &str) -> Result<String> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_locate_tag(&mut s.store, prefix, tag)
        })?
        .map_err(from_wit)
    }

    /// The generation counter of `prefix`.
    pub(crate) fn generation_name(&self, prefix: &str) -> Result<String> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_generation_name(&mut s.store, prefix)
        })
    }

    /// The generation a counter holding `stored` says.
    pub(crate) fn generation_of(&self, stored: Option<&[u8]>) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_generation_of(&mut s.store, stored)
        })
    }

    /// What `clear` writes over a counter holding `stored`, and the new generation.
    pub(crate) fn next_generation(&self, stored: Option<&[u8]>, now_ms: u64) -> Result<(Vec<u8>, u64)> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_next_generation(&mut s.store, stored, now_ms)
        })
    }

    /// What `known` becomes on `news` about the prefix's generation, the generation the
    /// caller uses, and whether L1 must be flushed.
    pub(crate) fn hear_generation(
        &self,
        known: KnownGeneration,
        news: GenerationNews,
    ) -> Result<GenerationHeeded> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_hear_generation(&mut s.store, known, news)
        })
    }

    /// How many tags a process may keep before it sweeps out lapsed ones, once a sweep
    /// left `kept`.
    pub(crate) fn tag_sweep_at(&self, kept: usize) -> Result<usize> {
        let at = self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_tag_sweep_at(&mut s.store, kept as u64)
        })?;
        Ok(usize::try_from(at).unwrap_or(usize::MAX))
    }

    /// What a process whose L1 is its own knows of its generation at its start.
    pub(crate) fn process_generation(&self) -> Result<KnownGeneration> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_process_generation(&mut s.store)
        })
    }

    /// What is kept of a tag's moments after `news` of it, whether a moment L1 judged
    /// by moved, and what the caller's call judges by.
    pub(crate) fn hear_tag(&self, kept: Option<KeptTag>, news: TagNews, now_ms: u64) -> Result<TagHeeded> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_hear_tag(&mut s.store, kept, news, now_ms)
        })
    }

    /// The generation that may stand in for the store's when a read of it fails.
    pub(crate) fn generation_fallback(&self, known: KnownGeneration) -> Result<Option<u64>> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_generation_fallback(&mut s.store, known)
        })
    }

    /// The tag and clear channel of `prefix`.
    pub(crate) fn invalidation_channel(&self, prefix: &str) -> Result<String> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_invalidation_channel(&mut s.store, prefix)
        })
    }

    /// A tag or clear announcement's text.
    pub(crate) fn encode_message(&self, origin: &str, message: &TagMessage) -> Result<String> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_encode_message(&mut s.store, origin, message)
        })
    }

    /// Reads a tag or clear announcement.
    pub(crate) fn decode_message(&self, text: &str) -> Result<Option<(String, TagMessage)>> {
        self.call(|s| {
            s.guest
                .corral_cache_policy()
                .call_decode_message(&mut s.store, text)
        })
    }

    /// The landing channel of `prefix`.
    pub(crate) fn channel(&self, prefix: &str) -> Result<String> {
        self.call(|s| s.guest.corral_cache_policy().call_channel(&mut s.store, prefix))
    }

    /// Decodes stored bytes without judging them; corrupt bytes are an error.
    pub(crate) fn decode(&self, stored: &[u8]) -> Result<Decoded> {
        let limits = self.inner.limits;
        let head = &stored[..stored.len().min(self.inner.header_len)];
        let d = self
            .call(|s| {
                s.guest
                    .corral_cache_policy()
                    .call_decode(&mut s.store, head, stored.len() as u64, limits)
            })?
            .map_err(from_wit)?;
        Ok(Decoded {
            meta: meta_out(d.meta),
            value_len: d.value_len as usize,
            kept_by_store: d.kept_by_store,
        })
    }

    /// Starts a get-or-set flight at `now_ms`: judges key and options as at `judged_ms`
    /// (when its call judged them), returns the first action.
    pub(crate) fn flight_start(
        &self,
        key: &str,
        options: &EntryOptions,
        config: wflight::FlightConfig,
        judged_ms: u64,
        now_ms: u64,
    ) -> Result<(wflight::FlightState, wflight::Action)> {
        let limits = self.inner.limits;
        let options = options_in(options);
        self.call(|s| {
            s.guest.corral_cache_flight().call_start(
                &mut s.store,
                key,
                options,
                config,
                judged_ms,
                now_ms,
                limits,
            )
        })?
        .map_err(from_wit)
    }

    /// Feeds one event to a flight; returns the new state and the next action.
    pub(crate) fn flight_step(
        &self,
        state: wflight::FlightState,
        event: wflight::Event,
        now_ms: u64,
    ) -> Result<(wflight::FlightState, wflight::Action)> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest
                .corral_cache_flight()
                .call_step(&mut s.store, state, event, now_ms, limits)
        })
    }

    /// Whether an abandoned flight holds the lock (and so owes a release).
    pub(crate) fn flight_abandon(&self, state: wflight::FlightState) -> Result<bool> {
        self.call(|s| s.guest.corral_cache_flight().call_abandon(&mut s.store, state))
    }

    /// Until when an entry filled into L1 at `now_ms` may be served from L1.
    pub(crate) fn l1_deadline(&self, meta: WitMeta, now_ms: u64, l1_ttl_ms: u64) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_cache_flight()
                .call_l1_deadline(&mut s.store, meta, now_ms, l1_ttl_ms)
        })
    }

    /// Checks a lock request (key rules, positive TTL).
    pub(crate) fn lock_check_request(&self, key: &str, ttl_ms: u64) -> Result<()> {
        let limits = self.inner.limits;
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_check_request(&mut s.store, key, ttl_ms, limits)
        })?
        .map_err(from_wit)
    }

    /// The entry to store if the lock is free at `now_ms`.
    pub(crate) fn lock_try(
        &self,
        current: Option<&Held>,
        owner: &str,
        ttl_ms: u64,
        now_ms: u64,
    ) -> Result<Option<Held>> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_try_lock(&mut s.store, current, owner, ttl_ms, now_ms)
        })
    }

    /// The free record to store if `owner` holds the lock at `now_ms`.
    pub(crate) fn lock_release(
        &self,
        current: Option<&Held>,
        owner: &str,
        now_ms: u64,
    ) -> Result<Option<Held>> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_release(&mut s.store, current, owner, now_ms)
        })
    }

    pub(crate) fn lock_is_expired(&self, current: Option<&Held>, now_ms: u64) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_is_expired(&mut s.store, current, now_ms)
        })
    }

    pub(crate) fn lock_is_locked_by(&self, current: Option<&Held>, owner: &str, now_ms: u64) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_is_locked_by(&mut s.store, current, owner, now_ms)
        })
    }

    pub(crate) fn lock_sweepable(&self, entry: &Held, now_ms: u64) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_sweepable(&mut s.store, entry, now_ms)
        })
    }

    /// How often an in-memory lock table sweeps (ms).
    pub(crate) fn lock_sweep_interval_ms(&self) -> Result<u64> {
        self.call(|s| s.guest.corral_lock_policy().call_sweep_interval_ms(&mut s.store))
    }

    /// How long to keep releasing an acquire whose outcome is unknown (ms).
    pub(crate) fn lock_orphan_window_ms(&self, ttl_ms: u64) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_orphan_window_ms(&mut s.store, ttl_ms)
        })
    }

    pub(crate) fn lock_fair_waiter(&self, started_us: u64, token: &str) -> Result<String> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_fair_waiter(&mut s.store, started_us, token)
        })
    }

    pub(crate) fn lock_next_try(&self, attempt: u32, now_ms: u64, deadline_ms: u64) -> Result<Option<u64>> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_next_try(&mut s.store, attempt, now_ms, deadline_ms)
        })
    }

    pub(crate) fn lock_decide(
        &self,
        acquired: u32,
        servers: u32,
        ttl_ms: u64,
        elapsed_ms: u64,
    ) -> Result<Option<u64>> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_decide(&mut s.store, acquired, servers, ttl_ms, elapsed_ms)
        })
    }

    pub(crate) fn lock_has_quorum(&self, count: u32, servers: u32) -> Result<bool> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_has_quorum(&mut s.store, count, servers)
        })
    }

    pub(crate) fn lock_renew_after(&self, ttl_ms: u64) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_renew_after_ms(&mut s.store, ttl_ms)
        })
    }

    pub(crate) fn lock_fencing_token(&self, per_server: &[u64]) -> Result<u64> {
        self.call(|s| {
            s.guest
                .corral_lock_policy()
                .call_fencing_token(&mut s.store, per_server)
        })
    }

    /// The lock scripts (acquire with fencing, release, extend).
    pub(crate) fn lock_scripts(&self) -> &wlock::LockScripts {
        &self.inner.lock_scripts
    }

    /// The Lua a Redis store runs, and the TTL grace.
    pub(crate) fn scripts(&self) -> &crate::store::Scripts {
        &self.inner.scripts
    }

    /// Instances this handle has created so far: calls reuse them (one per thread that
    /// calls, plus the pool), so this stays small however many calls were made.
    #[cfg(any(test, feature = "test-util"))]
    pub fn instances_created(&self) -> u64 {
        self.inner.created.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// An envelope decoded without judging it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Decoded {
    /// Its metadata as written.
    pub(crate) meta: EntryMeta,
    /// How long its value is.
    pub(crate) value_len: usize,
    /// Whether the store's TTL, not `meta`, keeps its current expiry moment.
    pub(crate) kept_by_store: bool,
}

/// An entry checked at a moment (see [`Policy::check`]).
#[cfg(any(test, feature = "test-util"))]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Freshness {
    /// Fresh, with the metadata after a sliding touch.
    Fresh {
        /// The metadata after the touch.
        meta: EntryMeta,
        /// Whether the touch moved the expiry.
        moved: bool,
    },
    /// Past its expiry, within its fail-safe stale window.
    Stale,
    /// Expired.
    Expired,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    #[test]
    fn a_guest_past_its_budget_traps_into_a_typed_error_and_the_pool_recovers() {
        let policy = Policy::load(defaults().unwrap().limits).unwrap();
        let limits = policy.inner.limits;
        // A budget of 0 ticks: the first epoch check in the guest traps.
        let e = policy
            .call_with_budget(0, |s| {
                s.guest
                    .corral_cache_policy()
                    .call_validate_key(&mut s.store, "k", limits)
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Guest);
        assert!(e.to_string().contains("trapped"), "{e}");
        assert!(
            policy.validate_key("k").is_ok(),
            "a fresh instance serves the next call"
        );
        assert!(policy.validate_key(" ").is_err());
    }
}
