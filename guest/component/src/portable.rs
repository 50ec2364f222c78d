//! The portable body: the `cache` and `lock` exports, run inside the component against
//! the host's imports, with time from `wasi:clocks` (std's `SystemTime` on wasip2).
//!
//! Every decision is `corral-core`'s, the same the native host follows: this is the
//! other loop over the same actions.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use corral_core::generation::{Heard, Known, News};
use corral_core::policy::{self, ReadOutcome, Touch};
use corral_core::tags::{self, KeptTag, KeptTags, TagHeeded, TagMoments, TagNews, Tagged, Verdict};
use corral_core::{EntryMeta, Limits, Settings, envelope, flight, lock, names};

use super::bindings::corral::cache::{l1, l2, types};
use super::bindings::corral::lock::table;
use super::bindings::exports::corral::cache::cache as wcache;
use super::bindings::exports::corral::lock::lock as wlock;
use super::{Component, arg_error, options_in, settings_in};

mod driver;
mod two_phase;

/// This instance's settings: the core's defaults until `configure`.
static SETTINGS: Mutex<Settings> = Mutex::new(Settings::DEFAULT);

/// The origin of this body's tag and clear announcements: any but a native cache's
/// (a random token each), which skips only its own.
const ORIGIN: &str = "portable";

/// The prefix this instance names its data under (contract §2.4).
static PREFIX: Mutex<String> = Mutex::new(String::new());

fn settings() -> Settings {
    *SETTINGS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The tag moments this instance keeps (`corral_core::tags::KeptTag`), and the count of
/// L1's flushes they were learnt at ([`l1_clears`]): once the host heard a tag or clear
/// announcement, or missed some, they are read again (contract §7.5).
static MOMENTS: Mutex<Option<Kept>> = Mutex::new(None);

/// Tag moments as kept, with `l1_clears()` as it was when they were learnt.
struct Kept {
    clears: u64,
    moments: KeptTags,
}

/// What is kept of `tag`, unless L1 was flushed since (its flushes count `clears` now).
fn kept(tag: &str, clears: u64) -> Option<KeptTag> {
    let kept = MOMENTS.lock().unwrap_or_else(|e| e.into_inner());
    kept.as_ref()
        .filter(|k| k.clears == clears)
        .and_then(|k| k.moments.get(tag))
}

/// L1's flushes as what was heard ([`corral_core::generation::Heard`]): every flush
/// this instance did not make may hide an announcement, so each counts as a gap.
fn heard(flushes: u64) -> Heard {
    Heard {
        gaps: flushes,
        ..Heard::default()
    }
}

/// Takes in `news` of `tag`, learnt while L1's flushes counted `clears`, as the brain
/// says (`tags::hear_moments`): kept if L1 was not flushed since. Returns all the brain
/// said: what the caller's call judges by, and whether those are the store's own.
fn hear_tag(tag: &str, news: TagNews, clears: u64, now: u64) -> TagHeeded {
    let heeded = tags::hear_moments(kept(tag, clears), news, now);
    if let Some(now_kept) = heeded.kept
        && l1_clears() == clears
    {
        let mut kept = MOMENTS.lock().unwrap_or_else(|e| e.into_inner());
        let k = kept.get_or_insert_with(|| Kept {
            clears,
            moments: KeptTags::default(),
        });
        if k.clears != clears {
            k.clears = clears;
            k.moments.clear();
        }
        // This body judges every tagged L1 hit again: no tag epoch to move.
        let _swept = k.moments.keep(tag, now_kept, now);
    }
    heeded
}

/// A read of `tag`'s moments that began while L1's flushes counted `clears`.
fn read_of(stored: Option<&[u8]>, clears: u64, now: u64) -> TagNews {
    TagNews::Read {
        since: heard(clears),
        heard: heard(l1_clears()),
        found: KeptTag::news(
            TagMoments::decode(stored),
            tags::known_until(now, settings().l1_ttl_ms),
        ),
    }
}

/// What this instance knows of its prefix's generation (`corral_core::generation`), and
/// how many of L1's flushes ([`l1_clears`]) it has taken in. It hears no announcement
/// itself: a flush it did not make (a `clear` by another instance of this process, a
/// tag or clear announcement the host heard, a gap in them) is a gap to it, since a
/// clear may lie behind it.
static GENERATION: Mutex<Generation> = Mutex::new(Generation::NEW);

struct Generation {
    known: Known,
    /// L1's flushes taken in (`None`: not looked at yet, nothing known to lose).
    flushes: Option<u64>,
}

impl Generation {
    const NEW: Generation = Generation {
        known: Known::in_instance(),
        flushes: None,
    };
}

/// [`GENERATION`], with every flush of L1 since it last looked taken in.
fn known_generation() -> std::sync::MutexGuard<'static, Generation> {
    let flushes = l1_clears();
    let mut state = GENERATION.lock().unwrap_or_else(|e| e.into_inner());
    if state.flushes.is_some_and(|seen| seen != flushes) {
        state.known.hear(News::Gap);
    }
    state.flushes = Some(flushes);
    state
}

/// Until when the generation this instance names entries in is known without a read
/// (an L1 copy it makes lives no longer: `flight::l1_copy_until`).
fn generation_known_until() -> u64 {
    known_generation().known.until_ms
}

/// Takes in `news` and flushes L1 if the brain says so (that flush is this instance's
/// own: taken in, not a gap). Returns the generation the caller uses.
fn hear_generation(news: News) -> u64 {
    let mut state = known_generation();
    let heeded = state.known.hear(news);
    if heeded.flush_l1 {
        l1::clear();
        state.flushes = state.flushes.map(|seen| seen + 1);
    }
    heeded.generation
}

/// How many times this process's L1 was emptied (`l1-ticket.flushes`): a `clear` or
/// `flush` import call from any instance (a clear, a clock stepped back), a tag or clear
/// announcement the host heard, or a gap in the announcements (the host's channel was
/// re-established). Whatever this instance read
/// of the generation and the tags before is then read again: an invalidation may have
/// gone unheard, the way the native body forgets what it kept (contract §7.5).
fn l1_clears() -> u64 {
    l1::ticket("").flushes
}

fn prefix() -> String {
    let prefix = PREFIX.lock().unwrap_or_else(|e| e.into_inner());
    if prefix.is_empty() {
        names::DEFAULT_PREFIX.to_owned()
    } else {
        prefix.clone()
    }
}

/// The prefix's generation (clear): read from the store at most once per L1 TTL.
fn generation(now: u64) -> Result<u64, types::Error> {
    let since = {
        let known = known_generation().known;
        if let Some(generation) = known.usable(now) {
            return Ok(generation);
        }
        known.heard()
    };
    let stored = l2::get(&names::generation(&prefix()))?;
    Ok(hear_generation(News::Read {
        since,
        generation: tags::generation(stored.as_deref()),
        until_ms: tags::known_until(now, settings().l1_ttl_ms),
    }))
}

/// The names of `key`'s data in the current generation, once `key` passed the key rules.
fn locate(key: &str, limits: &Limits) -> Result<names::Names, types::Error> {
    corral_core::key::validate(key, limits).map_err(arg_error)?;
    let g = generation(now_ms())?;
    names::locate_in(&prefix(), key, g, limits).map_err(arg_error)
}

/// As [`locate`], for a get-or-set: when the generation cannot be read (the store is
/// failing), the one this instance knows if it may stand in (`Known::fallback`: read or
/// written since the last gap), so the flight degrades as it would without tags and
/// clear instead of failing (contract §5.8), as the native body does. Says whether the
/// names are known: an instance that never read a generation, or whose process's L1 was
/// flushed since (a clear may lie between), cannot name the key at all, and its flight
/// treats every store step as failed.
fn locate_for_flight(key: &str, limits: &Limits) -> Result<(names::Names, bool), types::Error> {
    corral_core::key::validate(key, limits).map_err(arg_error)?;
    locate_in_flight_generation(key, flight_generation(), limits)
}

/// The generation a get-or-set names its key's data in ([`locate_for_flight`]), and
/// whether the key's data can be named in it at all.
fn flight_generation() -> (u64, bool) {
    match generation(now_ms()) {
        Ok(g) => (g, true),
        Err(_) => match known_generation().known.fallback() {
            Some(g) => (g, true),
            None => (0, false),
        },
    }
}

/// The names of `key` (checked already) in `generation`, as [`flight_generation`] gave
/// it, and whether they are known.
fn locate_in_flight_generation(
    key: &str,
    (generation, known): (u64, bool),
    limits: &Limits,
) -> Result<(names::Names, bool), types::Error> {
    let names = names::locate_in(&prefix(), key, generation, limits).map_err(arg_error)?;
    Ok((names, known))
}

/// The moments of `tags` at `now`: kept ones while trusted, else read from the store.
/// Also says until when the answer may be trusted, and whether all of them are the
/// store's own (only those may delete an entry: `tags::judge`).
fn moments(tag_list: &[String], now: u64) -> Result<(Vec<TagMoments>, u64, bool), types::Error> {
    let mut out = Vec::with_capacity(tag_list.len());
    let mut until_all = u64::MAX;
    let mut stored_all = true;
    // One count for the whole judgement (an import call, not one per tag).
    let clears = l1_clears();
    for tag in tag_list {
        let (using, stored) = match kept(tag, clears).filter(|k| k.usable(now).is_some()) {
            Some(kept) => (kept, false),
            None => {
                let name = names::tag_name(&prefix(), tag).map_err(arg_error)?;
                let stored = l2::get(&name)?;
                let heeded = hear_tag(tag, read_of(stored.as_deref(), clears, now), clears, now);
                (heeded.using, heeded.stored)
            }
        };
        until_all = until_all.min(using.until_ms);
        stored_all &= stored;
        out.push(using.moments);
    }
    Ok((out, until_all, stored_all))
}

/// The `written_at` of a tagged write (a set, or a load) that begins at `now`: after
/// every invalidation of `tag_list` the store holds now, read afresh (what this instance
/// keeps may predate another process's invalidation), else, the store failing, after
/// those kept (contract §7.5). An untagged write is written at `now`.
fn written_at(tag_list: &[String], now: u64) -> Result<u64, types::Error> {
    let mut known = Vec::with_capacity(tag_list.len());
    let clears = l1_clears();
    for tag in tag_list {
        let name = names::tag_name(&prefix(), tag).map_err(arg_error)?;
        let m = match l2::get(&name) {
            Ok(stored) => {
                hear_tag(tag, read_of(stored.as_deref(), clears, now), clears, now)
                    .using
                    .moments
            }
            Err(_) => kept(tag, clears).map(|k| k.moments).unwrap_or_default(),
        };
        known.push(m);
    }
    Ok(tags::written_at(now, &known))
}

/// What `tagged`'s tags say about an entry with `meta` now, and until when L1 may keep
/// it (an untagged entry: untouched, no bound).
fn judge(tagged: Option<&Tagged>, meta: &EntryMeta, now: u64) -> Result<(Verdict, u64), types::Error> {
    let Some(tagged) = tagged else {
        return Ok((Verdict::Untouched, u64::MAX));
    };
    let (m, until, stored) = moments(&tagged.tags, now)?;
    match tags::judge(tagged, meta, &m, stored, now) {
        // By moments the store may have lost: judged again by the store's own, as
        // every other process judges it.
        Verdict::Hidden => {
            let (found, heeded) = store_moments(&tagged.tags, now)?;
            Ok(tags::judge_again(tagged, meta, &found, &heeded, now))
        }
        verdict => Ok((verdict, until)),
    }
}

/// The moments of `tag_list` as the store holds them now, read afresh, and what hearing
/// each read said.
fn store_moments(tag_list: &[String], now: u64) -> Result<(Vec<TagMoments>, Vec<TagHeeded>), types::Error> {
    let clears = l1_clears();
    let mut found = Vec::with_capacity(tag_list.len());
    let mut heeded = Vec::with_capacity(tag_list.len());
    for tag in tag_list {
        let name = names::tag_name(&prefix(), tag).map_err(arg_error)?;
        let stored = l2::get(&name)?;
        found.push(TagMoments::decode(stored.as_deref()));
        heeded.push(hear_tag(
            tag,
            read_of(stored.as_deref(), clears, now),
            clears,
            now,
        ));
    }
    Ok((found, heeded))
}

fn tagged_in(t: types::Tagged) -> Tagged {
    Tagged {
        written_at_ms: t.written_at_ms,
        tags: t.tags,
    }
}

fn tagged_out(t: &Tagged) -> types::Tagged {
    types::Tagged {
        written_at_ms: t.written_at_ms,
        tags: t.tags.clone(),
    }
}

/// A removal's nonce: random (std's hasher seeds come from `wasi:random`).
fn removal_nonce() -> [u8; 8] {
    use std::hash::BuildHasher;
    std::collections::hash_map::RandomState::new()
        .hash_one(now_ms())
        .to_be_bytes()
}

/// The latest reading of the wall clock this instance took.
static LATEST_MS: AtomicU64 = AtomicU64::new(0);

/// The wall clock (Unix ms), watched for steps back (contract §7.5). What this
/// instance knows it keeps until wall-clock moments (the generation, the tags' moments,
/// the host's L1 copies), which a step back pushes away by the step; so a reading the
/// brain calls a step back (`generation::stepped_back`) is a gap in what was heard: L1
/// is emptied (`l1.flush`: loads in flight still coalesce, the key is not changed), and
/// this instance and every other of the process, seeing its flushes move, read the
/// generation and the tags again. Each instance watches its own readings: a step is
/// taken in by every instance that read the clock before it (more flushes, never
/// fewer), and an instance made after it starts from its first reading.
fn now_ms() -> u64 {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let latest = LATEST_MS.fetch_max(now, Ordering::Relaxed);
    if corral_core::generation::stepped_back(latest, now) {
        LATEST_MS.store(now, Ordering::Relaxed);
        l1::flush();
    }
    now
}

/// What an L2 read found.
enum Found {
    /// A fresh entry: its value, metadata, tags, and until when L1 may keep it by them.
    Fresh(Vec<u8>, EntryMeta, Option<Tagged>, u64),
    /// A stale copy (fail-safe): its value and metadata.
    Stale(Vec<u8>, EntryMeta),
    /// Nothing servable.
    Nothing,
}

impl Found {
    /// The fresh value, if any: what a plain read returns.
    fn fresh(self) -> Option<(Vec<u8>, EntryMeta, Option<Tagged>, u64)> {
        match self {
            Found::Fresh(value, meta, tagged, until) => Some((value, meta, tagged, until)),
            Found::Stale(..) | Found::Nothing => None,
        }
    }
}

/// One L2 read of the entry `name` at `now`: judged by the policy; a sliding touch is
/// written back only over the very bytes read; expired and corrupt bytes are removed; a
/// stale copy is left in place.
fn l2_read(name: &str, now: u64, limits: &Limits) -> Result<Found, types::Error> {
    l2_read_holding(name, now, limits).map(|(found, _)| found)
}

/// [`l2_read`], and what the key holds once the read is done (the bytes found, touched,
/// or `None` once it removed them), for a fill fenced on it (contract §5.12).
fn l2_read_holding(name: &str, now: u64, limits: &Limits) -> Result<(Found, Option<Vec<u8>>), types::Error> {
    judge_read(name, l2::get(name), now, limits)
}

/// What a read of an entry's name brought from L2: its bytes, if any, or the failure.
type StoredRead = Result<Option<Vec<u8>>, types::Error>;

/// [`l2_read_holding`] of what a read of `name` already brought (`read`: one of a
/// batch's reads, made together).
fn judge_read(
    name: &str,
    read: StoredRead,
    now: u64,
    limits: &Limits,
) -> Result<(Found, Option<Vec<u8>>), types::Error> {
    let stored = match read {
        Ok(Some(stored)) => stored,
        Ok(None) => return Ok((Found::Nothing, None)),
        // Not bytes at all (another Redis type): a miss, removed (contract §4).
        Err(types::Error::Corrupt(_)) => {
            l2::delete(name)?;
            return Ok((Found::Nothing, None));
        }
        Err(e) => return Err(e),
    };
    let outcome = policy::read(&stored, stored.len() as u64, now, limits, None);
    // A tagged entry is judged by its tags' moments too (contract §7.5).
    let (verdict, tags_until) = match &outcome {
        ReadOutcome::Fresh(hit) | ReadOutcome::Stale(hit) => judge(hit.tagged.as_ref(), &hit.meta, now)?,
        _ => (Verdict::Untouched, u64::MAX),
    };
    let outcome = match (outcome, verdict) {
        (ReadOutcome::Fresh(hit) | ReadOutcome::Stale(hit), Verdict::Stale(meta)) => {
            let copy = stored[hit.value_offset..].to_vec();
            return Ok((Found::Stale(copy, meta), Some(stored)));
        }
        (ReadOutcome::Fresh(_) | ReadOutcome::Stale(_), Verdict::Removed) => ReadOutcome::Expired,
        // Judged again by the store's own moments (`judge`), and still not servable as
        // it is (stale past a moment the store lost): a miss, left in the store.
        (ReadOutcome::Fresh(_) | ReadOutcome::Stale(_), Verdict::Hidden) => {
            return Ok((Found::Nothing, Some(stored)));
        }
        (outcome, _) => outcome,
    };
    match outcome {
        ReadOutcome::Stale(hit) => {
            if let Some(Touch::Expire) = hit.touch {
                l2::replace_if_equal(name, &stored, &stored, hit.store_ttl_ms)?;
            }
            let copy = stored[hit.value_offset..].to_vec();
            Ok((Found::Stale(copy, hit.meta), Some(stored)))
        }
        ReadOutcome::Fresh(hit) => {
            let value = stored[hit.value_offset..].to_vec();
            let holds = match hit.touch {
                Some(Touch::Rewrite(header)) => {
                    // The fixed header only: the bytes after it (tags, value) stay.
                    let touched = envelope::splice(&header, &stored[header.len()..]);
                    l2::replace_if_equal(name, &stored, &touched, hit.store_ttl_ms)?;
                    touched
                }
                // The same bytes with a new TTL: the store slides the moment it keeps.
                Some(Touch::Expire) => {
                    l2::replace_if_equal(name, &stored, &stored, hit.store_ttl_ms)?;
                    stored
                }
                None => stored,
            };
            Ok((Found::Fresh(value, hit.meta, hit.tagged, tags_until), Some(holds)))
        }
        ReadOutcome::Expired | ReadOutcome::Corrupt(_) => {
            l2::delete_if_equal(name, &stored)?;
            Ok((Found::Nothing, None))
        }
        // A tombstone stays: a fill replaces exactly it.
        ReadOutcome::Removed { .. } => Ok((Found::Nothing, Some(stored))),
    }
}

/// The value L1 may serve for `key` at `now`: a stale copy fail-safe re-armed only when
/// `stale_ok` (a get-or-set; a plain read never returns one).
fn l1_hit(key: &str, now: u64, stale_ok: bool) -> Option<Vec<u8>> {
    l1_entry(key, now, stale_ok).map(|e| e.value)
}

/// A tagged entry is judged by its tags again: one invalidated since it was filled is
/// dropped (the read goes on to L2).
fn l1_entry(key: &str, now: u64, stale_ok: bool) -> Option<l1::L1Entry> {
    let e = l1::get(key).filter(|e| now < e.until_ms && (stale_ok || !e.stale))?;
    if let Some(tagged) = &e.tagged {
        let tagged = tagged_in(tagged.clone());
        // Only whether a tag touches it matters here: any touch is an L1 miss. Tags
        // that cannot be read now are a miss too: the read goes to L2, and a failing
        // store is met there as any other read meets it (a get-or-set degrades).
        match judge(Some(&tagged), &UNBOUNDED, now) {
            Ok((Verdict::Untouched, _)) => {}
            Ok(_) => {
                l1::delete(key);
                return None;
            }
            Err(_) => return None,
        }
    }
    Some(e)
}

/// Whether two L1 entries are the same copy (a refresh's disarming replaces only it).
fn same_copy(a: &l1::L1Entry, b: &l1::L1Entry) -> bool {
    a.until_ms == b.until_ms && a.refresh_at_ms == b.refresh_at_ms && a.stale == b.stale && a.value == b.value
}

/// Metadata that makes a tag judgement say only whether any tag touches an entry.
const UNBOUNDED: EntryMeta = EntryMeta {
    absolute_ms: None,
    sliding_ms: None,
    expires_at_ms: u64::MAX,
    stale_ms: None,
};

/// How a value reaches L1, with the ticket taken before the L2 step it comes from
/// (contract §5.12).
#[derive(Clone, Copy)]
enum L1Fill {
    /// A read found it: no write of the key since may be overwritten.
    Read(l1::L1Ticket),
    /// This process wrote it to L2: it replaces any older fill, unless the key was
    /// written again since.
    Write(l1::L1Ticket),
}

/// A ticket of `key` as of now, but as of `named` for changes of the prefix's
/// generation: the entry was named in the generation known then.
fn ticket_since(key: &str, named: l1::L1Ticket) -> l1::L1Ticket {
    l1::L1Ticket {
        generations: named.generations,
        ..l1::ticket(key)
    }
}

fn fill_l1(key: &str, value: &[u8], meta: &EntryMeta, tagged: Option<&Tagged>, tags_until: u64, how: L1Fill) {
    let until_ms = flight::l1_copy_until(
        flight::l1_deadline(meta, now_ms(), settings().l1_ttl_ms),
        matches!(how, L1Fill::Read(_)),
        generation_known_until(),
        tags_until,
    );
    let entry = l1::L1Entry {
        value: value.to_vec(),
        until_ms,
        stale: false,
        refresh_at_ms: None,
        tagged: tagged.map(tagged_out),
    };
    match how {
        L1Fill::Read(ticket) => {
            l1::fill(key, &entry, ticket);
        }
        L1Fill::Write(ticket) => l1::set(key, &entry, ticket),
    }
}

/// Moves `tag`'s moment (a removal or an expiry) to now, only over the bytes read
/// (nothing: only where nothing is), and announces it to the other processes.
fn invalidate_tag(tag: &str, remove: bool) -> Result<(), types::Error> {
    let name = names::tag_name(&prefix(), tag).map_err(arg_error)?;
    let how = if remove {
        tags::Invalidation::Remove
    } else {
        tags::Invalidation::Expire
    };
    for _ in 0..settings().cas_tries {
        let now = now_ms();
        let stored = l2::get(&name)?;
        let m = tags::update(stored.as_deref(), how, now);
        if l2::set_if(&name, stored.as_deref(), &m.encode(), tags::state_ttl_ms(now))? {
            // Every instance of this process judges again at once, without waiting for
            // the announcement to come back (a clear of L1 moves their count).
            l1::clear();
            let wrote = KeptTag::news(m, tags::known_until(now, settings().l1_ttl_ms));
            let clears = l1_clears();
            hear_tag(tag, TagNews::Wrote(wrote), clears, now);
            announce(&tags::Message::Tag {
                tag: tag.to_owned(),
                moments: m,
            });
            return Ok(());
        }
    }
    Err(types::Error::Unavailable(format!(
        "the moments of tag {tag:?} kept changing"
    )))
}

/// Tells the other processes of a tag or clear invalidation (contract §7.5): they drop
/// what it invalidates from their L1 at once, instead of within their L1 TTL.
fn announce(message: &tags::Message) {
    l2::announce_invalidation(&tags::encode(ORIGIN, message));
}

/// An expiry of the entry `names` names (contract §7.4): a stale rewrite only over the
/// bytes read, a few tries over a concurrent writer; then a removal, which wins.
fn expire_named(names: &names::Names, settings: &Settings) -> Result<bool, types::Error> {
    let remove = |was_fresh: bool| {
        let (tombstone, ttl_ms) = policy::removal(settings.lock_ttl_ms, &removal_nonce());
        l2::swap(&names.entry, &tombstone, ttl_ms)?;
        Ok(was_fresh)
    };
    // A few tries over what a concurrent writer leaves; then a removal, which wins.
    for _ in 0..3 {
        let Some(stored) = l2::get(&names.entry)? else {
            return remove(false);
        };
        match policy::expire(&stored, stored.len() as u64, now_ms(), &settings.limits) {
            policy::Expire::Rewrite {
                was_fresh,
                header,
                store_ttl_ms,
                value_offset,
            } => {
                let expired = envelope::splice(&header, &stored[value_offset..]);
                if l2::replace_if_equal(&names.entry, &stored, &expired, store_ttl_ms)? {
                    return Ok(was_fresh);
                }
            }
            policy::Expire::Remove { was_fresh } => return remove(was_fresh),
        }
    }
    remove(false)
}

/// A removal or an expiry of `key`, `change` its store step on the entry's names
/// (contract §5.12): this process's copy goes before the entry is named (naming may
/// need the store), and again after the store step, even a failed one (it may have
/// landed): a read that began before may have filled L1 meanwhile. Then the other
/// processes hear of it.
fn dropping(
    key: &str,
    settings: &Settings,
    change: impl FnOnce(&names::Names) -> Result<bool, types::Error>,
) -> Result<bool, types::Error> {
    corral_core::key::validate(key, &settings.limits).map_err(arg_error)?;
    l1::delete(key);
    let names = locate(key, &settings.limits)?;
    let changed = change(&names);
    l1::delete(key);
    l2::announce_landing(key);
    changed
}

fn check_tags(tag_list: &[String]) -> Result<(), types::Error> {
    tags::check(tag_list).map_err(arg_error)
}

impl wcache::Guest for Component {
    fn configure(s: types::Settings, prefix: String) -> Result<(), types::Error> {
        let s = settings_in(s);
        s.check().map_err(arg_error)?;
        *SETTINGS.lock().unwrap_or_else(|e| e.into_inner()) = s;
        *PREFIX.lock().unwrap_or_else(|e| e.into_inner()) = prefix;
        // What was read under another prefix or clock says nothing here.
        *MOMENTS.lock().unwrap_or_else(|e| e.into_inner()) = None;
        *GENERATION.lock().unwrap_or_else(|e| e.into_inner()) = Generation::NEW;
        Ok(())
    }

    fn get(key: String) -> Result<Option<Vec<u8>>, types::Error> {
        let now = now_ms();
        if let Some(v) = l1_hit(&key, now, false) {
            return Ok(Some(v));
        }
        let limits = settings().limits;
        // Before the entry is named: a clear after it (another generation) refuses the fill.
        let ticket = l1::ticket(&key);
        let names = locate(&key, &limits)?;
        Ok(l2_read(&names.entry, now, &limits)?
            .fresh()
            .map(|(value, meta, tagged, until)| {
                fill_l1(&key, &value, &meta, tagged.as_ref(), until, L1Fill::Read(ticket));
                value
            }))
    }

    fn set(key: String, value: Vec<u8>, options: types::EntryOptions) -> Result<(), types::Error> {
        Self::set_tagged(key, value, options, Vec::new())
    }

    fn set_tagged(
        key: String,
        value: Vec<u8>,
        options: types::EntryOptions,
        tag_list: Vec<String>,
    ) -> Result<(), types::Error> {
        let now = now_ms();
        let limits = settings().limits;
        let plan = policy::plan_set(&key, value.len() as u64, &options_in(options), now, &limits)
            .map_err(arg_error)?;
        check_tags(&tag_list)?;
        let written_at_ms = written_at(&tag_list, now)?;
        let tagged = Tagged {
            written_at_ms,
            tags: tag_list,
        };
        let (header, ttl) =
            policy::tag_plan(&plan.header, plan.store_ttl_ms, &tagged, now, &limits).map_err(arg_error)?;
        let named = l1::ticket(&key);
        let names = locate(&key, &limits)?;
        // This process stops serving the old value before the store changes.
        l1::delete(&key);
        let ticket = ticket_since(&key, named);
        let stored = envelope::splice(&header, &value);
        if let Err(e) = l2::set(&names.entry, &stored, ttl) {
            // The write may have landed all the same: the other processes drop their copy.
            l2::announce_landing(&key);
            return Err(e);
        }
        l2::announce_landing(&key);
        let tagged = (!tagged.tags.is_empty()).then_some(tagged);
        match judge(tagged.as_ref(), &plan.meta, now)? {
            (Verdict::Untouched, until) => {
                fill_l1(
                    &key,
                    &value,
                    &plan.meta,
                    tagged.as_ref(),
                    until,
                    L1Fill::Write(ticket),
                );
            }
            _ => l1::delete(&key),
        }
        Ok(())
    }

    fn remove_by_tag(tag: String) -> Result<(), types::Error> {
        invalidate_tag(&tag, true)
    }

    fn expire_by_tag(tag: String) -> Result<(), types::Error> {
        invalidate_tag(&tag, false)
    }

    fn clear() -> Result<(), types::Error> {
        let name = names::generation(&prefix());
        for _ in 0..settings().cas_tries {
            let now = now_ms();
            let since = known_generation().known.heard();
            let stored = l2::get(&name)?;
            let (bytes, g) = tags::next_generation(stored.as_deref(), now);
            if l2::set_if(&name, stored.as_deref(), &bytes, tags::state_ttl_ms(now))? {
                hear_generation(News::OwnClear {
                    since,
                    generation: g,
                    until_ms: tags::known_until(now, settings().l1_ttl_ms),
                });
                announce(&tags::Message::Clear { generation: g });
                return Ok(());
            }
        }
        Err(types::Error::Unavailable(
            "the generation kept changing".to_string(),
        ))
    }

    fn refresh(key: String) -> Result<bool, types::Error> {
        let limits = settings().limits;
        let names = locate(&key, &limits)?;
        Ok(l2_read(&names.entry, now_ms(), &limits)?.fresh().is_some())
    }

    fn remove(key: String) -> Result<bool, types::Error> {
        let settings = settings();
        dropping(&key, &settings, |names| {
            // A removal leaves a tombstone, as in every body (contract §5.12), and says
            // whether it replaced a fresh entry: what the swap found, in the same step.
            let (tombstone, ttl_ms) = policy::removal(settings.lock_ttl_ms, &removal_nonce());
            let old = l2::swap(&names.entry, &tombstone, ttl_ms)?;
            Ok(old.is_some_and(|old| {
                matches!(
                    policy::read(&old, old.len() as u64, now_ms(), &settings.limits, None),
                    ReadOutcome::Fresh(_)
                )
            }))
        })
    }

    fn expire(key: String) -> Result<bool, types::Error> {
        let settings = settings();
        dropping(&key, &settings, |names| expire_named(names, &settings))
    }

    type Load = two_phase::Loading;
    type Follower = two_phase::Following;

    fn begin(
        key: String,
        options: types::EntryOptions,
        bypass: bool,
        tags: Vec<String>,
    ) -> Result<wcache::Begun, types::Error> {
        two_phase::begin(key, options, bypass, tags)
    }

    fn begin_many(
        keys: Vec<String>,
        options: types::EntryOptions,
        bypass: bool,
        tags: Vec<String>,
    ) -> Result<Vec<Result<wcache::Begun, types::Error>>, types::Error> {
        two_phase::begin_many(keys, options, bypass, tags)
    }
}

fn held_in(h: table::Held) -> lock::Held {
    lock::Held {
        owner: h.owner,
        expires_at_ms: h.expires_at_ms,
        token: h.token,
    }
}

fn held_out(h: lock::Held) -> table::Held {
    table::Held {
        owner: h.owner,
        expires_at_ms: h.expires_at_ms,
        token: h.token,
    }
}

/// Takes `key` for `owner` if it is free: the acquire's fencing token, or none. A swap
/// that finds the record changed since its read lost to a change that may have taken
/// nothing (another key's record forgotten, which raises a table's floor; a release):
/// the lock is read again, up to the settings' `cas_tries` times, and answered busy
/// only when a read finds it held.
fn acquire(key: &str, owner: &str, ttl_ms: u64) -> Result<Option<u64>, types::Error> {
    lock::check_request(key, ttl_ms, &settings().limits).map_err(arg_error)?;
    for _ in 0..settings().cas_tries {
        let current = table::get(key);
        let Some(new) = lock::try_lock(current.clone().map(held_in).as_ref(), owner, ttl_ms, now_ms()) else {
            return Ok(None);
        };
        let token = new.token;
        // Atomic: of racing callers, only the one whose swap finds the record unchanged
        // (its token included) wins.
        if table::compare_and_swap(key, current.as_ref(), &held_out(new)) {
            return Ok(Some(token));
        }
    }
    Ok(None)
}

impl wlock::Guest for Component {
    fn try_lock(key: String, owner: String, ttl_ms: u64) -> Result<bool, types::Error> {
        Ok(acquire(&key, &owner, ttl_ms)?.is_some())
    }

    fn acquire(key: String, owner: String, ttl_ms: u64) -> Result<Option<u64>, types::Error> {
        acquire(&key, &owner, ttl_ms)
    }

    fn unlock(key: String, owner: String) -> Result<bool, types::Error> {
        // As `acquire`: a swap that lost to a change is judged again on a new read.
        for _ in 0..settings().cas_tries {
            let current = table::get(&key);
            let Some(free) = lock::release(current.clone().map(held_in).as_ref(), &owner, now_ms()) else {
                return Ok(false);
            };
            if table::compare_and_swap(&key, current.as_ref(), &held_out(free)) {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn is_locked_by(key: String, owner: String) -> Result<bool, types::Error> {
        Ok(lock::is_locked_by(
            table::get(&key).map(held_in).as_ref(),
            &owner,
            now_ms(),
        ))
    }

    fn is_lock_expired(key: String) -> Result<bool, types::Error> {
        Ok(lock::is_expired(table::get(&key).map(held_in).as_ref(), now_ms()))
    }
}
