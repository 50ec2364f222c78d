//! Tags and clear in the native body (contract §7.5). The guest decides every rule
//! (`corral-core`'s `tags`: the envelope's tag section, the moments, the verdict, the
//! generation in the names, the announcements); this file performs the I/O:
//!
//! - the moments of each tag this process judged an entry by, kept in a small map
//!   until the guest's `tag-known-until` (the L1 TTL), merged forward with what
//!   announcements say, and forgotten with L1 when the subscription had a gap;
//! - the prefix's generation, read once and then kept as long (an announced clear
//!   moves it at once);
//! - `remove_by_tag`, `expire_by_tag` and `clear`: one compare-and-set on one small
//!   key, then an announcement on the prefix's invalidation channel. No key is scanned.
//!
//! L1 serves a tagged entry only in the tag epoch it was judged in ([`L1Tagged`]): an
//! invalidation this process hears of moves the epoch on, and the next hit of every
//! tagged entry is judged again (through L2).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use parking_lot::Mutex;

use super::Corral;
use super::metrics::Metrics;
use crate::clock::Clock;
use crate::guest::Policy;
use crate::guest::policy::{
    GenerationFound, GenerationNews, Heard, KeptTag, KnownGeneration, TagHeeded, TagMessage, TagMoments,
    TagNews, TagRead, TagVerdict, Tagged, WitMeta,
};
use crate::store::l1::{L1, L1Tagged};
use crate::{Error, ErrorKind, Result};

/// What this process knows of its prefix's tags and generation.
pub(crate) struct TagState {
    /// Per tag: its moments, and until when they may judge an entry without a read.
    moments: Mutex<KeptTags>,
    /// What is known of the prefix's generation, as the guest keeps it
    /// (`corral-core`'s `generation`): changed only by what `hear-generation` answers.
    known: Mutex<KnownGeneration>,
    /// `known`'s generation and until when it may be used, for reads without the lock.
    generation: AtomicU64,
    generation_until: AtomicU64,
    /// The brain, which holds every rule of what is known.
    policy: Policy,
    /// This cache's name on the invalidation channel (its own messages are not news).
    origin: String,
}

impl std::fmt::Debug for TagState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TagState")
            .field("tags", &self.moments.lock().map.len())
            .field("generation", &self.generation.load(Ordering::Relaxed))
            .finish()
    }
}

impl TagState {
    pub(crate) fn new(policy: Policy) -> Result<Self> {
        let known = policy.process_generation()?;
        Ok(TagState {
            moments: Mutex::new(KeptTags {
                map: HashMap::new(),
                sweep_at: policy.tag_sweep_at(0)?,
            }),
            // This process's L1 is its own (empty now): judged in generation 0.
            known: Mutex::new(known),
            generation: AtomicU64::new(known.generation),
            generation_until: AtomicU64::new(known.until_ms),
            policy,
            origin: crate::lock_token(),
        })
    }

    /// Takes in `news` about the generation, as the guest says: what is known now, the
    /// generation the caller uses, and whether L1 must be flushed. Should the guest not
    /// answer (a trap), nothing known is trusted or kept any more, L1 is flushed, and
    /// the caller uses what the news says (a read's or a clear's generation).
    fn hear(&self, news: GenerationNews) -> (u64, bool) {
        let mut known = self.known.lock();
        let (generation, flush) = match self.policy.hear_generation(*known, news) {
            Ok(heeded) => {
                *known = heeded.known;
                (heeded.generation, heeded.flush_l1)
            }
            Err(_) => {
                known.until_ms = 0;
                known.trusted = false;
                known.heard.gaps += 1;
                let told = match news {
                    GenerationNews::Read(found) | GenerationNews::OwnClear(found) => found.generation,
                    GenerationNews::Announced((generation, _)) => generation,
                    GenerationNews::Gap => known.generation,
                };
                (told, true)
            }
        };
        self.generation.store(known.generation, Ordering::Release);
        self.generation_until.store(known.until_ms, Ordering::Release);
        (generation, flush)
    }

    /// This cache's own clear wrote `generation`, its write having begun when
    /// [`Self::heard_so_far`] said `since`; kept until `until` (the guest decides).
    fn hear_own_clear(&self, since: Heard, generation: u64, until_ms: u64) {
        self.hear(GenerationNews::OwnClear(GenerationFound {
            since,
            generation,
            until_ms,
        }));
    }

    /// Another process's clear moved the prefix to `generation`, as announced: says
    /// whether L1 must be flushed.
    fn hear_announced_clear(&self, generation: u64, until_ms: u64) -> bool {
        self.hear(GenerationNews::Announced((generation, until_ms))).1
    }

    /// What was heard so far: taken before a generation or tag read.
    pub(crate) fn heard_so_far(&self) -> Heard {
        self.known.lock().heard
    }

    /// Takes in `generation`, read from the store after [`Self::heard_so_far`] said
    /// `since`, kept until `until` if nothing was heard meanwhile: the generation the
    /// caller is to use, and whether L1 must be flushed.
    fn keep_read(&self, since: Heard, generation: u64, until_ms: u64) -> (u64, bool) {
        self.hear(GenerationNews::Read(GenerationFound {
            since,
            generation,
            until_ms,
        }))
    }

    /// Announcements may have been missed: everything kept is read again, and a read
    /// on its way now (it may have been answered before what was missed) is not kept.
    pub(crate) fn forget(&self) {
        self.hear(GenerationNews::Gap);
        self.moments.lock().map.clear();
    }

    /// Takes in `found`, `tag`'s moments read from the store after
    /// [`Self::heard_so_far`] said `since`, as the guest says (`hear-tag`: not kept if a
    /// clear or a gap was heard meanwhile). Returns what the caller's call judges by,
    /// whether a moment L1 judged by moved, and whether those are the store's own.
    fn learn_read(&self, since: Heard, tag: &str, found: KeptTag, now: u64) -> TagHeeded {
        // Held while what is kept changes: a gap heard meanwhile forgets it after.
        let known = self.known.lock();
        let news = TagNews::Read(TagRead {
            since,
            heard: known.heard,
            found,
        });
        // Should the guest not answer, the tag is dropped: judge L1's entries again.
        self.heed(tag, news, now).unwrap_or(TagHeeded {
            kept: None,
            moved: true,
            using: kept_tag(found.moments, now),
            stored: true,
        })
    }

    /// Takes in `news` of `tag`'s moments, as announced or as this process's own
    /// invalidation wrote them: says whether a moment L1 judged by moved (should the
    /// guest not answer, what is kept of the tag is dropped, and it did).
    fn learn(&self, tag: &str, news: TagNews, now: u64) -> bool {
        self.heed(tag, news, now).is_none_or(|heeded| heeded.moved)
    }

    /// What the guest says of `news` after keeping what it says to keep of `tag`
    /// (`None` if it trapped: then nothing is kept of the tag), `moved` also when L1's
    /// tagged entries must be judged again because lapsed tags were swept out.
    fn heed(&self, tag: &str, news: TagNews, now: u64) -> Option<TagHeeded> {
        let mut kept = self.moments.lock();
        match self.policy.hear_tag(kept.get(tag), news, now) {
            Ok(heeded) => {
                let swept = heeded.kept.is_some_and(|k| kept.keep(tag, k, now, &self.policy));
                Some(TagHeeded {
                    moved: heeded.moved || swept,
                    ..heeded
                })
            }
            Err(_) => {
                kept.map.remove(tag);
                None
            }
        }
    }

    /// Until when the generation kept may name entries without a read of the store.
    pub(crate) fn generation_known_until(&self) -> u64 {
        self.generation_until.load(Ordering::Acquire)
    }

    /// The generation as last known (no I/O).
    pub(crate) fn generation_now(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// The generation that may stand in for the store's when a read of it fails, as
    /// the guest says (`generation-fallback`): the one last known, if it was read (or
    /// written) since the last gap in the announcements; else `None`, and entries named
    /// in it are not to be read: an entry a clear left would be served.
    pub(crate) fn fallback(&self) -> Option<u64> {
        let known = *self.known.lock();
        self.policy.generation_fallback(known).ok().flatten()
    }

    /// The moments kept of `tags` (those this process knows, lapsed or not), for a
    /// write's stamp when the store cannot be read (no I/O): a stamp after them is
    /// never older than an invalidation this process knew of.
    pub(crate) fn known_moments(&self, tags: &[String]) -> Vec<TagMoments> {
        let kept = self.moments.lock();
        tags.iter()
            .filter_map(|tag| kept.get(tag).map(|k| k.moments))
            .collect()
    }

    /// What is kept of `tag`, if it may judge an entry at `now` without a read.
    fn usable(&self, tag: &str, now: u64) -> Option<KeptTag> {
        self.moments.lock().get(tag).filter(|k| now < k.until_ms)
    }
}

/// News of a tag's `moments`, usable until `until_ms`: nothing judged by them yet
/// (`kept-tag.judged` is the guest's to set).
fn kept_tag(moments: TagMoments, until_ms: u64) -> KeptTag {
    KeptTag {
        moments,
        until_ms,
        judged: false,
    }
}

/// The tags' moments a process keeps, as `corral-core`'s `tags::KeptTags` keeps them
/// (its types are the WIT ones here): what has lapsed is swept out once the map
/// reaches the size the guest says (`tag-sweep-at`), and a sweep that drops a tag that
/// may have judged an entry (`kept-tag.judged`, as the guest set it) moves L1's tag
/// epoch on.
struct KeptTags {
    /// Per tag: what is kept.
    map: HashMap<String, KeptTag>,
    /// The size at which lapsed tags are swept out next.
    sweep_at: usize,
}

impl KeptTags {
    /// Keeps `kept` of `tag`; says whether lapsed tags were swept out. Should the guest
    /// not say when to sweep next, nothing is swept any more (the map is still emptied
    /// at every gap in the announcements).
    fn keep(&mut self, tag: &str, kept: KeptTag, now: u64, policy: &Policy) -> bool {
        match self.map.get_mut(tag) {
            Some(k) => *k = kept,
            None => {
                self.map.insert(tag.to_owned(), kept);
            }
        }
        if self.map.len() < self.sweep_at {
            return false;
        }
        let mut judged_swept = false;
        self.map.retain(|_, k| {
            let stays = now < k.until_ms;
            judged_swept |= !stays && k.judged;
            stays
        });
        self.sweep_at = policy.tag_sweep_at(self.map.len()).unwrap_or(usize::MAX);
        judged_swept
    }

    /// What is kept of `tag`, lapsed or not.
    fn get(&self, tag: &str) -> Option<KeptTag> {
        self.map.get(tag).copied()
    }
}

/// The hook that hears tag and clear announcements (this process's own included).
pub(crate) fn invalidation_hook(
    state: Arc<TagState>,
    policy: Policy,
    l1: L1,
    clock: Arc<dyn Clock>,
    l1_ttl_ms: u64,
    metrics: Arc<Metrics>,
) -> crate::store::InvalidationHook {
    Arc::new(move |text: &str| {
        let Ok(Some((origin, message))) = policy.decode_message(text) else {
            return;
        };
        if origin == state.origin {
            return;
        }
        let now = clock.now_ms();
        match message {
            TagMessage::Tag((tag, moments)) => {
                let until_ms = policy.tag_known_until(now, l1_ttl_ms).unwrap_or(now);
                let news = TagNews::Announced(kept_tag(moments, until_ms));
                if state.learn(&tag, news, now) {
                    l1.bump_tags();
                }
                Metrics::bump(&metrics.l1_invalidations);
            }
            TagMessage::Clear(generation) => {
                let until = policy.tag_known_until(now, l1_ttl_ms).unwrap_or(now);
                if state.hear_announced_clear(generation, until) {
                    l1.clear_generation();
                    Metrics::bump(&metrics.l1_flushes);
                }
            }
        }
    })
}

/// A tagged entry as L1 keeps it, and until when its tags' moments are known.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TagStamp {
    pub(crate) tagged: L1Tagged,
    pub(crate) until_ms: u64,
}

impl Corral {
    /// The generation, if it is known now (no I/O).
    pub(crate) fn known_generation(&self) -> Option<u64> {
        let state = &self.inner.tags;
        (self.inner.clock.now_ms() < state.generation_known_until())
            .then(|| state.generation.load(Ordering::Acquire))
    }

    /// The prefix's generation: kept, or read from the store when not known (at the
    /// start, after a gap in announcements, or once the L1 TTL passed since).
    pub(crate) async fn generation(&self) -> Result<u64> {
        let state = &self.inner.tags;
        let now = self.inner.clock.now_ms();
        if now < state.generation_known_until() {
            return Ok(state.generation.load(Ordering::Acquire));
        }
        let policy = &self.inner.policy;
        let name = policy.generation_name(&self.inner.prefix)?;
        let since = state.heard_so_far();
        let stored = self.l2_op(self.inner.stores.entries.get(&name)).await?;
        self.adopt_generation(since, stored.as_deref(), now)
    }

    /// The generation the store held (`stored`, read after [`TagState::heard_so_far`]
    /// said `since`), kept, and L1 moved on if it changed; a clear heard while it was
    /// read set a newer one, which it returns instead.
    pub(crate) fn adopt_generation(&self, since: Heard, stored: Option<&[u8]>, now: u64) -> Result<u64> {
        let state = &self.inner.tags;
        let policy = &self.inner.policy;
        let g = policy.generation_of(stored)?;
        let until = policy.tag_known_until(now, self.inner.l1_ttl_ms)?;
        let (generation, flush) = state.keep_read(since, g, until);
        if flush {
            // Another process cleared (or the counter was lost): L1 was judged by the
            // names of another generation.
            self.inner.l1.clear_generation();
        }
        Ok(generation)
    }

    /// The moments of `tags` at `now`, until when all of them are known, and whether
    /// all are the store's own (only those may delete an entry: `judge-tags`): kept
    /// ones, else read from the store (one read per tag not kept).
    async fn moments_of(&self, tags: &[String], now: u64) -> Result<(Vec<TagMoments>, u64, bool)> {
        let inner = &*self.inner;
        let mut out = Vec::with_capacity(tags.len());
        let mut until_all = u64::MAX;
        let mut stored_all = true;
        for tag in tags {
            let (using, stored) = match inner.tags.usable(tag, now) {
                Some(kept) => (kept, false),
                None => {
                    let name = inner.policy.locate_tag(&inner.prefix, tag)?;
                    let since = inner.tags.heard_so_far();
                    let stored = self.l2_op(inner.stores.entries.get(&name)).await?;
                    let found = kept_tag(
                        inner.policy.tag_moments_of(stored.as_deref())?,
                        inner.policy.tag_known_until(now, inner.l1_ttl_ms)?,
                    );
                    let heeded = inner.tags.learn_read(since, tag, found, now);
                    if heeded.moved {
                        inner.l1.bump_tags();
                    }
                    (heeded.using, heeded.stored)
                }
            };
            until_all = until_all.min(using.until_ms);
            stored_all &= stored;
            out.push(using.moments);
        }
        Ok((out, until_all, stored_all))
    }

    /// The moments of `tags` as the store holds them now (one read per tag, in
    /// parallel), learnt and merged with what this process keeps. A write stamped after
    /// them ([`Self::tagged_write_at`]) is newer than every invalidation of its tags that
    /// completed before it began, in any process, whatever the processes' clocks say.
    pub(crate) async fn moments_now(&self, tags: &[String], now: u64) -> Result<Vec<TagMoments>> {
        let read = self.read_moments(tags, now).await?;
        Ok(read.into_iter().map(|(_, heeded)| heeded.using.moments).collect())
    }

    /// Each of `tags`' moments read from the store now (in parallel) and learnt: the
    /// store's own, and what the guest says of them once learnt.
    async fn read_moments(&self, tags: &[String], now: u64) -> Result<Vec<(TagMoments, TagHeeded)>> {
        let inner = &*self.inner;
        let since = inner.tags.heard_so_far();
        let reads = tags.iter().map(|tag| async move {
            let name = inner.policy.locate_tag(&inner.prefix, tag)?;
            let stored = self.l2_op(inner.stores.entries.get(&name)).await?;
            inner.policy.tag_moments_of(stored.as_deref())
        });
        let read = futures::future::try_join_all(reads).await?;
        let until_ms = inner.policy.tag_known_until(now, inner.l1_ttl_ms)?;
        let mut learnt = Vec::with_capacity(tags.len());
        for (tag, stored) in tags.iter().zip(read) {
            let found = kept_tag(stored, until_ms);
            let heeded = inner.tags.learn_read(since, tag, found, now);
            if heeded.moved {
                inner.l1.bump_tags();
            }
            learnt.push((stored, heeded));
        }
        Ok(learnt)
    }

    /// The `written_at` of a tagged write (a set, or a load) that begins now: after
    /// every invalidation of `tags` the store holds (read now, by `deadline`), else, the
    /// store failing, after those this process keeps.
    pub(crate) async fn tagged_write_at(&self, tags: &[String], deadline: tokio::time::Instant) -> u64 {
        let inner = &*self.inner;
        let now = inner.clock.now_ms();
        let moments = match tokio::time::timeout_at(deadline, self.moments_now(tags, now)).await {
            Ok(Ok(moments)) => moments,
            _ => inner.tags.known_moments(tags),
        };
        inner.policy.tag_written_at(now, &moments).unwrap_or(now)
    }

    /// Judges a tagged entry (metadata `meta`) by its tags at `now`: the guest's
    /// verdict, and what L1 keeps of it if it is untouched. The tag epoch is read
    /// before the moments, so an invalidation heard meanwhile is not missed.
    pub(crate) async fn judge_tagged(
        &self,
        tagged: Tagged,
        meta: WitMeta,
        now: u64,
    ) -> Result<(TagVerdict, TagStamp)> {
        let epoch = self.inner.l1.tag_epoch();
        let policy = &self.inner.policy;
        let (moments, mut until_ms, stored) = self.moments_of(&tagged.tags, now).await?;
        let mut verdict = policy.judge_tags(&tagged, meta, &moments, stored, now)?;
        if let TagVerdict::Hidden = verdict {
            // By moments the store may have lost: judged again by the store's own
            // (`tags::judge_again`), as every other process judges it.
            let read = self.read_moments(&tagged.tags, now).await?;
            let (found, heeded): (Vec<TagMoments>, Vec<TagHeeded>) = read.into_iter().unzip();
            (verdict, until_ms) = policy.judge_tags_again(&tagged, meta, &found, &heeded, now)?;
        }
        Ok((
            verdict,
            TagStamp {
                tagged: Some(epoch),
                until_ms,
            },
        ))
    }

    /// Judges a value this process just wrote with `tagged` (a set, or a load that began
    /// at `tagged.written_at_ms`): what L1 may keep of it, if anything.
    pub(crate) async fn stamp_written(&self, tagged: Tagged, now: u64) -> Result<Option<TagStamp>> {
        // Whether any tag touches it is all that matters here: a touched value is not
        // kept in L1 (the next read judges it in L2).
        let meta = WitMeta {
            absolute_ms: None,
            sliding_ms: None,
            expires_at_ms: u64::MAX,
            stale_ms: None,
        };
        let (verdict, stamp) = self.judge_tagged(tagged, meta, now).await?;
        Ok(matches!(verdict, TagVerdict::Untouched).then_some(stamp))
    }

    /// Every entry carrying `tag`, in every process sharing the store, is removed: a
    /// miss from now on (contract §7.5). No key is scanned: the tag's one small key
    /// gets the moment, the other processes hear of it on the invalidation channel
    /// (and drop what their L1 holds of it), and every reader compares. Returns once
    /// the announcement is published (or the store timeout passed: it is then retried
    /// in the background for the L1 TTL, after which no process serves the entries from
    /// L1 any more).
    ///
    /// An entry written at or before this moment (by the writer's clock) is removed:
    /// one written in the same millisecond counts as older, unless it was written after
    /// this process knew of the removal (a `set_tagged` after `remove_by_tag` here is
    /// newer, and is served; contract §7.5).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`] naming `tag` (empty, or over 128 bytes);
    /// [`ErrorKind::Unavailable`] when the store fails.
    pub async fn remove_by_tag(&self, tag: &str) -> Result<()> {
        self.invalidate_tag(tag, true)
            .await
            .map_err(|e| e.in_call("remove_by_tag"))
    }

    /// Every entry carrying `tag` is stale from now, in every process: an entry with a
    /// fail-safe window ([`EntryOptions::fail_safe`](crate::EntryOptions::fail_safe))
    /// keeps its stale copy for it, which a get-or-set whose reload fails still serves;
    /// one without is a miss (contract §7.5).
    ///
    /// # Errors
    /// As [`remove_by_tag`](Self::remove_by_tag).
    pub async fn expire_by_tag(&self, tag: &str) -> Result<()> {
        self.invalidate_tag(tag, false)
            .await
            .map_err(|e| e.in_call("expire_by_tag"))
    }

    async fn invalidate_tag(&self, tag: &str, remove: bool) -> Result<()> {
        let inner = &*self.inner;
        let name = inner.policy.locate_tag(&inner.prefix, tag)?;
        let updated = self
            .compare_and_set(&name, |stored, now| {
                let (moments, bytes) = inner.policy.tag_update(stored, remove, now)?;
                Ok((bytes, moments))
            })
            .await?;
        let Some((moments, now)) = updated else {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!("the moments of tag {tag:?} kept changing under this invalidation"),
            ));
        };
        let until_ms = inner.policy.tag_known_until(now, inner.l1_ttl_ms)?;
        inner
            .tags
            .learn(tag, TagNews::Wrote(kept_tag(moments, until_ms)), now);
        inner.l1.bump_tags();
        Metrics::bump(&inner.metrics.tag_invalidations);
        let message = inner
            .policy
            .encode_message(&inner.tags.origin, &TagMessage::Tag((tag.to_owned(), moments)))?;
        self.publish(message).await;
        Ok(())
    }

    /// Writes `update`'s bytes over what the key `name` holds, only if it still holds
    /// it (compare-and-set, retried up to the guest's `cas_tries` times over concurrent writers).
    /// Returns `update`'s answer and the moment of the write that landed, or `None`
    /// when every try lost.
    async fn compare_and_set<T>(
        &self,
        name: &str,
        update: impl Fn(Option<&[u8]>, u64) -> Result<(Vec<u8>, T)>,
    ) -> Result<Option<(T, u64)>> {
        let inner = &*self.inner;
        let entries = &inner.stores.entries;
        for _ in 0..inner.cas_tries {
            let now = inner.clock.now_ms();
            let stored = self.l2_op(entries.get(name)).await?;
            let (bytes, answer) = update(stored.as_deref(), now)?;
            let ttl = inner.policy.tag_state_ttl(now)?;
            let written = self
                .l2_op(entries.set_if(name, stored, Bytes::from(bytes), ttl))
                .await?;
            if written {
                return Ok(Some((answer, now)));
            }
        }
        Ok(None)
    }

    /// Invalidates every entry of this cache's prefix at once, in every process: the
    /// prefix moves to a new generation (one counter, compare-and-set), which every
    /// entry's and flight lock's name carries; older entries are never read again and
    /// lapse by their TTLs. Never `KEYS`, `SCAN` or `FLUSH*`; other prefixes (tenants)
    /// are untouched. Returns once announced, as [`remove_by_tag`](Self::remove_by_tag).
    ///
    /// # Errors
    /// [`ErrorKind::Unavailable`] when the store fails.
    pub async fn clear(&self) -> Result<()> {
        self.clear_generation().await.map_err(|e| e.in_call("clear"))
    }

    /// [`clear`](Self::clear), with the store's own messages.
    async fn clear_generation(&self) -> Result<()> {
        let inner = &*self.inner;
        let name = inner.policy.generation_name(&inner.prefix)?;
        let since = inner.tags.heard_so_far();
        let updated = self
            .compare_and_set(&name, |stored, now| inner.policy.next_generation(stored, now))
            .await?;
        let Some((generation, now)) = updated else {
            return Err(Error::new(
                ErrorKind::Unavailable,
                "the generation kept changing under this clear",
            ));
        };
        let until = inner.policy.tag_known_until(now, inner.l1_ttl_ms)?;
        inner.tags.hear_own_clear(since, generation, until);
        inner.l1.clear_generation();
        Metrics::bump(&inner.metrics.clears);
        let message = inner
            .policy
            .encode_message(&inner.tags.origin, &TagMessage::Clear(generation))?;
        self.publish(message).await;
        Ok(())
    }

    /// Publishes a tag or clear announcement, waiting at most the store timeout; one
    /// not published then is retried in the background on the schedule of every change
    /// retried so ([`Corral::retry_in_background`]), for the L1 TTL.
    async fn publish(&self, message: String) {
        let notifications = self.inner.stores.notifications.clone();
        let bound = self.inner.flight.store_timeout;
        let publish = move || {
            let (notifications, message) = (notifications.clone(), message.clone());
            async move {
                matches!(
                    tokio::time::timeout(bound, notifications.publish_invalidation(&message)).await,
                    Ok(Ok(()))
                )
            }
        };
        if publish().await {
            return;
        }
        // Just tried: the next try waits the first retry wait.
        self.retry_in_background(
            "",
            false,
            "a tag or clear announcement could not be published within the L1 TTL",
            publish,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::policy::defaults;

    // The rules are `corral-core`'s (`generation`, with its own tests); these check that
    // this body feeds them and keeps what they answer.

    fn state() -> TagState {
        TagState::new(Policy::load(defaults().unwrap().limits).unwrap()).unwrap()
    }

    fn until(state: &TagState) -> u64 {
        state.generation_known_until()
    }

    #[test]
    fn what_the_guest_answers_is_kept_and_used() {
        let state = state();
        assert_eq!(
            state.fallback(),
            None,
            "never read: a clear may have left entries under 0"
        );
        let (g, flush) = state.keep_read(state.heard_so_far(), 1_700_000_000_000, 10_000);
        assert_eq!((g, flush), (1_700_000_000_000, true), "L1 was judged in 0");
        assert_eq!(
            (state.generation_now(), until(&state)),
            (1_700_000_000_000, 10_000)
        );
        assert_eq!(state.fallback(), Some(1_700_000_000_000));
        // A read on its way across a gap is used, not kept.
        let since = state.heard_so_far();
        state.forget();
        assert_eq!(state.fallback(), None);
        assert_eq!(until(&state), 0, "read again");
        assert_eq!(
            state.keep_read(since, 1_700_000_000_500, 10_000),
            (1_700_000_000_500, false)
        );
        assert_eq!(state.generation_now(), 1_700_000_000_000);
    }

    #[test]
    fn announced_and_own_clears_move_the_generation() {
        let state = state();
        state.keep_read(state.heard_so_far(), 1_700_000_000_000, 10_000);
        assert!(state.hear_announced_clear(1_700_000_000_500, 20_000));
        assert_eq!(
            (state.generation_now(), until(&state)),
            (1_700_000_000_500, 10_000),
            "moved on, trusted no longer than the read"
        );
        assert!(!state.hear_announced_clear(1_700_000_000_500, 20_000), "no news");
        // A clear overlapping this cache's own: read again.
        let since = state.heard_so_far();
        state.hear_announced_clear(1_700_000_000_900, 20_000);
        state.hear_own_clear(since, 1_700_000_000_700, 30_000);
        assert_eq!((state.generation_now(), until(&state)), (1_700_000_000_700, 0));
        // A tag read across that clear is not kept.
        let moments = TagMoments {
            removed_ms: 1,
            expired_ms: 0,
        };
        let found = kept_tag(moments, 30_000);
        let heeded = state.learn_read(since, "t", found, 0);
        assert_eq!(
            (heeded.using.moments, heeded.using.until_ms, heeded.moved),
            (moments, 0, false),
            "for its call only"
        );
        assert!(state.usable("t", 0).is_none());
    }

    #[test]
    fn lapsed_tags_are_swept_out_once_the_map_doubles() {
        let state = state();
        let moments = TagMoments {
            removed_ms: 1,
            expired_ms: 0,
        };
        let kept = |until_ms| TagNews::Wrote(kept_tag(moments, until_ms));
        // A service whose tags each name one user: thousands, each judged by once. A
        // tag new to the process moves nothing, but a sweep does: an L1 copy judged by a
        // swept tag may outlive its bound (a fail-safe copy, a clock stepped back by
        // less than a step) and must be judged again.
        let moved = (0..10_000u64)
            .filter(|&n| state.learn(&format!("user:{n}"), kept(n + 1), n))
            .count();
        let size = state.moments.lock().map.len();
        assert!(size <= 2 * 1024, "{size} tags kept");
        assert!(moved >= 4, "every sweep moves L1's tag epoch: {moved} moves");
        // One that has not lapsed stays, however many come after it.
        state.learn("live", kept(u64::MAX), 10_000);
        for n in 10_000..20_000u64 {
            state.learn(&format!("user:{n}"), kept(n + 1), n);
        }
        assert!(state.usable("live", 20_000).is_some());
        assert_eq!(state.known_moments(&["live".to_owned()]), vec![moments]);
        // Announcements of tags this process never judged by are kept lapsed (until a
        // read in flight has merged them); sweeping them out moves no epoch.
        let state = self::state();
        let heard = |n: u64| TagNews::Announced(kept_tag(moments, n + 30_000));
        let moved = (20_000..30_000u64)
            .filter(|&n| state.learn(&format!("other:{n}"), heard(n), n))
            .count();
        assert_eq!(moved, 0, "no L1 entry was judged by them");
        assert!(state.moments.lock().map.len() <= 2 * 1024);
    }
}
