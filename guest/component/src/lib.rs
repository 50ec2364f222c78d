//! The Corral WebAssembly component: `corral-core` behind the WIT contract in `wit/`.
//!
//! This crate holds the project's only `generate!`/`export!`. Every export converts its
//! arguments, asks `corral-core`, and converts the answer back: no decision is made
//! here. It is built for `wasm32-wasip2` by `host/build.rs`; on any other target it is
//! empty (a native cdylib that exports WIT names cannot link).

#![cfg(target_arch = "wasm32")]

use corral_core::{Limits, envelope, expiry, generation, policy};

/// The generated bindings. The canonical-ABI glue they contain is `unsafe` by nature;
/// it is allowed here and nowhere else.
#[allow(unsafe_code)]
mod bindings {
    wit_bindgen::generate!({
        path: "../../wit",
        world: "corral:guest/guest",
        generate_all,
    });

    use super::Component;
    export!(Component);
}

mod portable;

use bindings::corral::cache::types;
use bindings::exports::corral::cache::policy as wit;

struct Component;

fn limits(l: types::Limits) -> Limits {
    Limits {
        max_key_bytes: l.max_key_bytes,
        max_value_bytes: l.max_value_bytes,
        default_sliding_ms: l.default_sliding_ms,
        sliding_in_store: l.sliding_in_store,
    }
}

fn limits_out(l: Limits) -> types::Limits {
    types::Limits {
        max_key_bytes: l.max_key_bytes,
        max_value_bytes: l.max_value_bytes,
        default_sliding_ms: l.default_sliding_ms,
        sliding_in_store: l.sliding_in_store,
    }
}

fn settings_in(s: types::Settings) -> corral_core::Settings {
    corral_core::Settings {
        limits: limits(s.limits),
        l1_ttl_ms: s.l1_ttl_ms,
        lock_wait_ms: s.lock_wait_ms,
        lock_ttl_ms: s.lock_ttl_ms,
        invalidation_interval_ms: s.invalidation_interval_ms,
        degraded_l1_ttl_ms: s.degraded_l1_ttl_ms,
        fail_safe_throttle_ms: s.fail_safe_throttle_ms,
        hard_timeout_ms: s.hard_timeout_ms,
        soft_timeout_ms: s.soft_timeout_ms,
        eager_refresh_permille: s.eager_refresh_permille,
        l1_capacity: s.l1_capacity,
        cas_tries: s.cas_tries,
        retry_first_ms: s.retry_first_ms,
        retry_max_ms: s.retry_max_ms,
        store_timeout_ms: s.store_timeout_ms,
    }
}

fn settings_out(s: corral_core::Settings) -> types::Settings {
    types::Settings {
        limits: limits_out(s.limits),
        l1_ttl_ms: s.l1_ttl_ms,
        lock_wait_ms: s.lock_wait_ms,
        lock_ttl_ms: s.lock_ttl_ms,
        invalidation_interval_ms: s.invalidation_interval_ms,
        degraded_l1_ttl_ms: s.degraded_l1_ttl_ms,
        fail_safe_throttle_ms: s.fail_safe_throttle_ms,
        hard_timeout_ms: s.hard_timeout_ms,
        soft_timeout_ms: s.soft_timeout_ms,
        eager_refresh_permille: s.eager_refresh_permille,
        l1_capacity: s.l1_capacity,
        cas_tries: s.cas_tries,
        retry_first_ms: s.retry_first_ms,
        retry_max_ms: s.retry_max_ms,
        store_timeout_ms: s.store_timeout_ms,
    }
}

fn budget_out(b: corral_core::flight::StoreBudget) -> types::StoreBudget {
    types::StoreBudget {
        before_load_ms: b.before_load_ms,
        refresh_before_load_ms: b.refresh_before_load_ms,
        after_load_ms: b.after_load_ms,
        release_ms: b.release_ms,
    }
}

fn budget_in(b: types::StoreBudget) -> corral_core::flight::StoreBudget {
    corral_core::flight::StoreBudget {
        before_load_ms: b.before_load_ms,
        refresh_before_load_ms: b.refresh_before_load_ms,
        after_load_ms: b.after_load_ms,
        release_ms: b.release_ms,
    }
}

fn meta_in(m: types::EntryMeta) -> corral_core::EntryMeta {
    corral_core::EntryMeta {
        absolute_ms: m.absolute_ms,
        sliding_ms: m.sliding_ms,
        expires_at_ms: m.expires_at_ms,
        stale_ms: m.stale_ms,
    }
}

fn meta_out(m: corral_core::EntryMeta) -> types::EntryMeta {
    types::EntryMeta {
        absolute_ms: m.absolute_ms,
        sliding_ms: m.sliding_ms,
        expires_at_ms: m.expires_at_ms,
        stale_ms: m.stale_ms,
    }
}

fn options_in(o: types::EntryOptions) -> corral_core::EntryOptions {
    corral_core::EntryOptions {
        absolute_ms: o.absolute_ms,
        relative_ms: o.relative_ms,
        sliding_ms: o.sliding_ms,
        max_stale_ms: o.max_stale_ms,
    }
}

fn arg_error(e: corral_core::ArgError) -> types::Error {
    types::Error::InvalidArgument(types::ArgError {
        name: e.arg.name().to_string(),
        reason: e.reason,
    })
}

fn hit_out(hit: policy::Hit) -> wit::Hit {
    wit::Hit {
        meta: meta_out(hit.meta),
        value_offset: hit.value_offset as u32,
        touch: hit.touch.map(|t| match t {
            policy::Touch::Rewrite(header) => wit::Touch::Rewrite(header.to_vec()),
            policy::Touch::Expire => wit::Touch::Expire,
        }),
        store_ttl_ms: hit.store_ttl_ms,
        next_read: next_read_out(hit.next_read),
        tagged: hit.tagged.map(tagged_out),
    }
}

fn next_read_out(next: policy::NextRead) -> wit::NextRead {
    match next {
        policy::NextRead::Get => wit::NextRead::Get,
        policy::NextRead::Script => wit::NextRead::Script,
        policy::NextRead::Expiring(ms) => wit::NextRead::Expiring(ms),
    }
}

fn tagged_out(t: corral_core::tags::Tagged) -> types::Tagged {
    types::Tagged {
        written_at_ms: t.written_at_ms,
        tags: t.tags,
    }
}

fn tagged_in(t: types::Tagged) -> corral_core::tags::Tagged {
    corral_core::tags::Tagged {
        written_at_ms: t.written_at_ms,
        tags: t.tags,
    }
}

fn moments_in(m: wit::TagMoments) -> corral_core::tags::TagMoments {
    corral_core::tags::TagMoments {
        removed_ms: m.removed_ms,
        expired_ms: m.expired_ms,
    }
}

fn moments_out(m: corral_core::tags::TagMoments) -> wit::TagMoments {
    wit::TagMoments {
        removed_ms: m.removed_ms,
        expired_ms: m.expired_ms,
    }
}

fn known_in(k: wit::KnownGeneration) -> generation::Known {
    generation::Known {
        generation: k.generation,
        until_ms: k.until_ms,
        trusted: k.trusted,
        heard: heard_in(k.heard),
        judges_l1: k.judges_l1,
    }
}

fn known_out(k: generation::Known) -> wit::KnownGeneration {
    wit::KnownGeneration {
        generation: k.generation,
        until_ms: k.until_ms,
        trusted: k.trusted,
        heard: wit::Heard {
            clears: k.heard.clears,
            gaps: k.heard.gaps,
            reads: k.heard.reads,
        },
        judges_l1: k.judges_l1,
    }
}

fn news_in(news: wit::GenerationNews) -> generation::News {
    let since = heard_in;
    match news {
        wit::GenerationNews::Read(f) => generation::News::Read {
            since: since(f.since),
            generation: f.generation,
            until_ms: f.until_ms,
        },
        wit::GenerationNews::OwnClear(f) => generation::News::OwnClear {
            since: since(f.since),
            generation: f.generation,
            until_ms: f.until_ms,
        },
        wit::GenerationNews::Announced((generation, until_ms)) => {
            generation::News::Announced { generation, until_ms }
        }
        wit::GenerationNews::Gap => generation::News::Gap,
    }
}

fn heard_in(h: wit::Heard) -> generation::Heard {
    generation::Heard {
        clears: h.clears,
        gaps: h.gaps,
        reads: h.reads,
    }
}

fn kept_tag_in(k: wit::KeptTag) -> corral_core::tags::KeptTag {
    corral_core::tags::KeptTag {
        moments: moments_in(k.moments),
        until_ms: k.until_ms,
        judged: k.judged,
    }
}

fn verdict_out(verdict: corral_core::tags::Verdict) -> wit::TagVerdict {
    use corral_core::tags::Verdict;
    match verdict {
        Verdict::Untouched => wit::TagVerdict::Untouched,
        Verdict::Stale(meta) => wit::TagVerdict::Stale(meta_out(meta)),
        Verdict::Removed => wit::TagVerdict::Removed,
        Verdict::Hidden => wit::TagVerdict::Hidden,
    }
}

fn heeded_in(h: wit::TagHeeded) -> corral_core::tags::TagHeeded {
    corral_core::tags::TagHeeded {
        kept: h.kept.map(kept_tag_in),
        moved: h.moved,
        using: kept_tag_in(h.using),
        stored: h.stored,
    }
}

fn kept_tag_out(k: corral_core::tags::KeptTag) -> wit::KeptTag {
    wit::KeptTag {
        moments: moments_out(k.moments),
        until_ms: k.until_ms,
        judged: k.judged,
    }
}

fn read_outcome(outcome: policy::ReadOutcome) -> wit::ReadOutcome {
    match outcome {
        policy::ReadOutcome::Fresh(hit) => wit::ReadOutcome::Fresh(hit_out(hit)),
        policy::ReadOutcome::Stale(hit) => wit::ReadOutcome::Stale(hit_out(hit)),
        policy::ReadOutcome::Expired => wit::ReadOutcome::Expired,
        policy::ReadOutcome::Corrupt(c) => wit::ReadOutcome::Corrupt(c.to_string()),
        policy::ReadOutcome::Removed { rearm } => wit::ReadOutcome::Removed(rearm),
    }
}

impl wit::Guest for Component {
    fn defaults() -> types::Settings {
        settings_out(corral_core::Settings::DEFAULT)
    }

    fn check_limits(l: types::Limits) -> Result<(), types::Error> {
        limits(l).check().map_err(arg_error)
    }

    fn check_settings(s: types::Settings) -> Result<(), types::Error> {
        settings_in(s).check().map_err(arg_error)
    }

    fn store_budget_for(s: types::Settings) -> types::StoreBudget {
        budget_out(settings_in(s).store_budget())
    }

    fn tag_read_ms(budget: types::StoreBudget, left_ms: u64, first_mark_in_ms: Option<u64>) -> u64 {
        budget_in(budget).tag_read_ms(left_ms, first_mark_in_ms)
    }

    fn validate_key(key: String, l: types::Limits) -> Result<(), types::Error> {
        corral_core::key::validate(&key, &limits(l)).map_err(arg_error)
    }

    fn plan_set(
        key: String,
        value_len: u64,
        options: types::EntryOptions,
        now_ms: u64,
        l: types::Limits,
    ) -> Result<wit::Plan, types::Error> {
        let options = options_in(options);
        let plan = policy::plan_set(&key, value_len, &options, now_ms, &limits(l)).map_err(arg_error)?;
        Ok(wit::Plan {
            meta: meta_out(plan.meta),
            header: plan.header.to_vec(),
            store_ttl_ms: plan.store_ttl_ms,
        })
    }

    fn check(meta: types::EntryMeta, now_ms: u64) -> wit::Freshness {
        match expiry::check(&meta_in(meta), now_ms) {
            expiry::Freshness::Fresh { meta, moved } => wit::Freshness::Fresh((meta_out(meta), moved)),
            expiry::Freshness::Stale => wit::Freshness::Stale,
            expiry::Freshness::Expired => wit::Freshness::Expired,
        }
    }

    fn expire(head: Vec<u8>, total_len: u64, now_ms: u64, l: types::Limits) -> wit::ExpirePlan {
        match policy::expire(&head, total_len, now_ms, &limits(l)) {
            policy::Expire::Rewrite {
                was_fresh,
                header,
                store_ttl_ms,
                value_offset,
            } => wit::ExpirePlan::Rewrite(wit::ExpireRewrite {
                was_fresh,
                header: header.to_vec(),
                store_ttl_ms,
                value_offset: value_offset as u32,
            }),
            policy::Expire::Remove { was_fresh } => wit::ExpirePlan::Remove(was_fresh),
        }
    }

    fn read(
        head: Vec<u8>,
        total_len: u64,
        now_ms: u64,
        l: types::Limits,
        slid_ms: Option<u64>,
    ) -> wit::ReadOutcome {
        read_outcome(policy::read(&head, total_len, now_ms, &limits(l), slid_ms))
    }

    fn locate(
        prefix: String,
        key: String,
        generation: u64,
        l: types::Limits,
    ) -> Result<wit::StoreNames, types::Error> {
        let n = corral_core::names::locate_in(&prefix, &key, generation, &limits(l)).map_err(arg_error)?;
        Ok(wit::StoreNames {
            entry: n.entry,
            flight_lock: n.flight_lock,
            lock: n.lock,
            fence: n.fence,
            queue: n.queue,
            waiting: n.waiting,
        })
    }

    fn locate_entries(
        prefix: String,
        keys: wit::Joined,
        generation: u64,
        l: types::Limits,
    ) -> Result<wit::Joined, (u32, types::Error)> {
        let keys = corral_core::names::Joined {
            text: keys.text,
            ends: keys.ends,
        };
        let names = corral_core::names::entries_of_joined(&prefix, &keys, generation, &limits(l))
            .map_err(|(at, e)| (u32::try_from(at).unwrap_or(u32::MAX), arg_error(e)))?;
        Ok(wit::Joined {
            text: names.text,
            ends: names.ends,
        })
    }

    fn read_many(
        heads: Vec<u8>,
        lens: Vec<u64>,
        now_ms: u64,
        l: types::Limits,
        l1_ttl_ms: u64,
    ) -> wit::JudgedMany {
        let limits = limits(l);
        let mut many = wit::JudgedMany {
            each: Vec::with_capacity(lens.len()),
            value_offsets: Vec::with_capacity(lens.len()),
            l1_until_ms: Vec::with_capacity(lens.len()),
            keep_until_ms: Vec::with_capacity(lens.len()),
            kept_len: Vec::with_capacity(lens.len()),
            flying: Vec::new(),
        };
        // Each read judged and answered as it is taken: no list of judgements between.
        let mut start = 0usize;
        for &total_len in &lens {
            // Each head is its read's first `HEAD_LEN` bytes (all of them, if fewer). A
            // head that does not fit in `heads` is judged as no head (`alone`, should
            // the read's length say it has bytes).
            let head_len = total_len.min(corral_core::batch::HEAD_LEN as u64) as usize;
            let end = start.saturating_add(head_len);
            let read = corral_core::batch::FirstRead {
                head: heads.get(start..end).unwrap_or_default(),
                total_len,
                slid_ms: None,
            };
            start = end;
            let (verdict, value_offset, l1_until_ms, (keep_until_ms, kept_len)) =
                match corral_core::batch::judge(&read, now_ms, &limits, l1_ttl_ms) {
                    corral_core::batch::Judged::Served(s) => {
                        let verdict = match s.next_read {
                            policy::NextRead::Get => wit::Verdict::Served,
                            policy::NextRead::Script => wit::Verdict::ServedSliding,
                            // Never (`batch::Served`); should it come, a plain read is
                            // a guess the read after it puts right.
                            policy::NextRead::Expiring(_) => {
                                debug_assert!(false, "a served read never sets a TTL");
                                wit::Verdict::Served
                            }
                        };
                        let kept = (s.keep_until_ms, s.kept_len as u32);
                        (verdict, s.value_offset as u32, s.l1_until_ms, kept)
                    }
                    corral_core::batch::Judged::Flies { outcome, l1_until_ms } => {
                        many.flying.push(wit::JudgedRead {
                            outcome: read_outcome(outcome),
                            l1_until_ms,
                        });
                        (wit::Verdict::Flies, 0, 0, (0, 0))
                    }
                    corral_core::batch::Judged::Alone => (wit::Verdict::Alone, 0, 0, (0, 0)),
                };
            many.each.push(verdict);
            many.value_offsets.push(value_offset);
            many.l1_until_ms.push(l1_until_ms);
            many.keep_until_ms.push(keep_until_ms);
            many.kept_len.push(kept_len);
        }
        many
    }

    fn batch_head_len() -> u32 {
        corral_core::batch::HEAD_LEN as u32
    }

    fn check_max_batch(max_batch: u64) -> Result<(), types::Error> {
        corral_core::batch::check_max_batch(max_batch).map_err(arg_error)
    }

    fn batch_calls(ready: u64, max_batch: Option<u64>) -> Vec<u64> {
        corral_core::batch::calls(ready, max_batch)
    }

    fn removal(lock_ttl_ms: u64, nonce: Vec<u8>) -> (Vec<u8>, u64) {
        policy::removal(lock_ttl_ms, &nonce)
    }

    fn locate_entry(
        prefix: String,
        key: String,
        generation: u64,
        l: types::Limits,
    ) -> Result<String, types::Error> {
        corral_core::names::locate_one_in(
            &prefix,
            &key,
            corral_core::names::Kind::Entry,
            generation,
            &limits(l),
        )
        .map_err(arg_error)
    }

    fn check_tags(tags: Vec<String>) -> Result<(), types::Error> {
        corral_core::tags::check(&tags).map_err(arg_error)
    }

    fn tag_plan(
        header: Vec<u8>,
        store_ttl_ms: u64,
        tagged: types::Tagged,
        now_ms: u64,
        l: types::Limits,
    ) -> Result<(Vec<u8>, u64), types::Error> {
        policy::tag_plan(&header, store_ttl_ms, &tagged_in(tagged), now_ms, &limits(l)).map_err(arg_error)
    }

    fn tag_written_at(now_ms: u64, known: Vec<wit::TagMoments>) -> u64 {
        let known: Vec<_> = known.into_iter().map(moments_in).collect();
        corral_core::tags::written_at(now_ms, &known)
    }

    fn judge_tags(
        tagged: types::Tagged,
        meta: types::EntryMeta,
        moments: Vec<wit::TagMoments>,
        stored: bool,
        now_ms: u64,
    ) -> wit::TagVerdict {
        let moments: Vec<_> = moments.into_iter().map(moments_in).collect();
        verdict_out(corral_core::tags::judge(
            &tagged_in(tagged),
            &meta_in(meta),
            &moments,
            stored,
            now_ms,
        ))
    }

    fn judge_tags_again(
        tagged: types::Tagged,
        meta: types::EntryMeta,
        found: Vec<wit::TagMoments>,
        heeded: Vec<wit::TagHeeded>,
        now_ms: u64,
    ) -> (wit::TagVerdict, u64) {
        let found: Vec<_> = found.into_iter().map(moments_in).collect();
        let heeded: Vec<_> = heeded.into_iter().map(heeded_in).collect();
        let (verdict, until) =
            corral_core::tags::judge_again(&tagged_in(tagged), &meta_in(meta), &found, &heeded, now_ms);
        (verdict_out(verdict), until)
    }

    fn tag_moments_of(stored: Option<Vec<u8>>) -> wit::TagMoments {
        moments_out(corral_core::tags::TagMoments::decode(stored.as_deref()))
    }

    fn tag_update(stored: Option<Vec<u8>>, remove: bool, now_ms: u64) -> (wit::TagMoments, Vec<u8>) {
        let how = if remove {
            corral_core::tags::Invalidation::Remove
        } else {
            corral_core::tags::Invalidation::Expire
        };
        let m = corral_core::tags::update(stored.as_deref(), how, now_ms);
        (moments_out(m), m.encode())
    }

    fn tag_state_ttl(now_ms: u64) -> u64 {
        corral_core::tags::state_ttl_ms(now_ms)
    }

    fn tag_known_until(now_ms: u64, l1_ttl_ms: u64) -> u64 {
        corral_core::tags::known_until(now_ms, l1_ttl_ms)
    }

    fn clock_stepped_back(latest_ms: u64, now_ms: u64) -> bool {
        corral_core::generation::stepped_back(latest_ms, now_ms)
    }

    fn tag_sweep_at(kept: u64) -> u64 {
        let kept = usize::try_from(kept).unwrap_or(usize::MAX);
        corral_core::tags::KeptTags::next_sweep(kept) as u64
    }

    fn process_generation() -> wit::KnownGeneration {
        known_out(generation::Known::in_process())
    }

    fn hear_tag(kept: Option<wit::KeptTag>, news: wit::TagNews, now_ms: u64) -> wit::TagHeeded {
        use corral_core::tags::TagNews;
        let news = match news {
            wit::TagNews::Read(read) => TagNews::Read {
                since: heard_in(read.since),
                heard: heard_in(read.heard),
                found: kept_tag_in(read.found),
            },
            wit::TagNews::Wrote(found) => TagNews::Wrote(kept_tag_in(found)),
            wit::TagNews::Announced(found) => TagNews::Announced(kept_tag_in(found)),
        };
        let heeded = corral_core::tags::hear_moments(kept.map(kept_tag_in), news, now_ms);
        wit::TagHeeded {
            kept: heeded.kept.map(kept_tag_out),
            moved: heeded.moved,
            using: kept_tag_out(heeded.using),
            stored: heeded.stored,
        }
    }

    fn locate_tag(prefix: String, tag: String) -> Result<String, types::Error> {
        corral_core::names::tag_name(&prefix, &tag).map_err(arg_error)
    }

    fn generation_name(prefix: String) -> String {
        corral_core::names::generation(&prefix)
    }

    fn generation_of(stored: Option<Vec<u8>>) -> u64 {
        corral_core::tags::generation(stored.as_deref())
    }

    fn next_generation(stored: Option<Vec<u8>>, now_ms: u64) -> (Vec<u8>, u64) {
        corral_core::tags::next_generation(stored.as_deref(), now_ms)
    }

    fn invalidation_channel(prefix: String) -> String {
        corral_core::names::invalidations(&prefix)
    }

    fn encode_message(origin: String, message: wit::TagMessage) -> String {
        let message = match message {
            wit::TagMessage::Tag((tag, moments)) => corral_core::tags::Message::Tag {
                tag,
                moments: moments_in(moments),
            },
            wit::TagMessage::Clear(generation) => corral_core::tags::Message::Clear { generation },
        };
        corral_core::tags::encode(&origin, &message)
    }

    fn hear_generation(known: wit::KnownGeneration, news: wit::GenerationNews) -> wit::GenerationHeeded {
        let mut known = known_in(known);
        let heeded = known.hear(news_in(news));
        wit::GenerationHeeded {
            known: known_out(known),
            generation: heeded.generation,
            flush_l1: heeded.flush_l1,
        }
    }

    fn generation_fallback(known: wit::KnownGeneration) -> Option<u64> {
        known_in(known).fallback()
    }

    fn decode_message(text: String) -> Option<(String, wit::TagMessage)> {
        let (origin, message) = corral_core::tags::decode(&text)?;
        let message = match message {
            corral_core::tags::Message::Tag { tag, moments } => {
                wit::TagMessage::Tag((tag, moments_out(moments)))
            }
            corral_core::tags::Message::Clear { generation } => wit::TagMessage::Clear(generation),
        };
        Some((origin.to_owned(), message))
    }

    fn channel(prefix: String) -> String {
        corral_core::names::channel(&prefix)
    }

    fn decode(head: Vec<u8>, total_len: u64, l: types::Limits) -> Result<wit::Decoded, types::Error> {
        let d = envelope::decode_header(&head, total_len, &limits(l))
            .map_err(|c| types::Error::Corrupt(c.to_string()))?;
        Ok(wit::Decoded {
            meta: meta_out(d.meta),
            value_offset: d.value_offset as u32,
            value_len: d.value_len as u32,
            kept_by_store: d.keeper == envelope::Keeper::Store,
        })
    }

    fn encode_header(meta: types::EntryMeta, value_len: u64) -> Vec<u8> {
        envelope::encode_header(&meta_in(meta), value_len, envelope::Keeper::Envelope).to_vec()
    }

    fn header_len() -> u32 {
        envelope::MAX_HEADER_LEN as u32
    }

    fn redis_read_script() -> String {
        corral_core::script::READ_AND_TOUCH.to_string()
    }

    fn redis_delete_if_equal_script() -> String {
        corral_core::script::DELETE_IF_EQUAL.to_string()
    }

    fn redis_lock_and_peek_script() -> String {
        corral_core::script::LOCK_AND_PEEK.to_string()
    }

    fn redis_fill_and_release_script() -> String {
        corral_core::script::FILL_AND_RELEASE.to_string()
    }

    fn redis_renew_fenced_script() -> String {
        corral_core::script::RENEW_FENCED.to_string()
    }

    fn redis_replace_if_equal_script() -> String {
        corral_core::script::REPLACE_IF_EQUAL.to_string()
    }

    fn store_ttl_grace_ms() -> u64 {
        expiry::STORE_TTL_GRACE_MS
    }
}

mod flight {
    //! The `flight` export: conversions around `corral_core::flight`.

    use corral_core::flight::{self as core, Action, Event, Flight, Outcome, Phase};

    use super::bindings::corral::cache::types;
    use super::bindings::exports::corral::cache::flight as wit;
    use super::{Component, arg_error, limits, meta_in, meta_out, options_in};

    fn options_out(o: corral_core::EntryOptions) -> types::EntryOptions {
        types::EntryOptions {
            absolute_ms: o.absolute_ms,
            relative_ms: o.relative_ms,
            sliding_ms: o.sliding_ms,
            max_stale_ms: o.max_stale_ms,
        }
    }

    fn config_in(c: wit::FlightConfig) -> core::FlightConfig {
        core::FlightConfig {
            lock_wait_ms: c.lock_wait_ms,
            lock_ttl_ms: c.lock_ttl_ms,
            l1_ttl_ms: c.l1_ttl_ms,
            degraded_l1_ttl_ms: c.degraded_l1_ttl_ms,
            fail_safe_throttle_ms: c.fail_safe_throttle_ms,
            hard_timeout_ms: c.hard_timeout_ms,
            soft_timeout_ms: c.soft_timeout_ms,
            eager_refresh_permille: c.eager_refresh_permille,
            background_completion: c.background_completion,
            refresh: c.refresh,
            bypass: c.bypass,
            // The native body's callers are handed the refreshes their flights start.
            starts_refresh: true,
        }
    }

    fn config_out(c: core::FlightConfig) -> wit::FlightConfig {
        wit::FlightConfig {
            lock_wait_ms: c.lock_wait_ms,
            lock_ttl_ms: c.lock_ttl_ms,
            l1_ttl_ms: c.l1_ttl_ms,
            degraded_l1_ttl_ms: c.degraded_l1_ttl_ms,
            fail_safe_throttle_ms: c.fail_safe_throttle_ms,
            hard_timeout_ms: c.hard_timeout_ms,
            soft_timeout_ms: c.soft_timeout_ms,
            eager_refresh_permille: c.eager_refresh_permille,
            background_completion: c.background_completion,
            refresh: c.refresh,
            bypass: c.bypass,
        }
    }

    fn phase_in(p: wit::Phase) -> Phase {
        match p {
            wit::Phase::Reading => Phase::Reading,
            wit::Phase::Locking => Phase::Locking,
            wit::Phase::DoubleChecking => Phase::DoubleChecking,
            wit::Phase::Waiting => Phase::Waiting,
            wit::Phase::Loading => Phase::Loading,
            wit::Phase::Writing => Phase::Writing,
            wit::Phase::Done => Phase::Done,
        }
    }

    fn phase_out(p: Phase) -> wit::Phase {
        match p {
            Phase::Reading => wit::Phase::Reading,
            Phase::Locking => wit::Phase::Locking,
            Phase::DoubleChecking => wit::Phase::DoubleChecking,
            Phase::Waiting => wit::Phase::Waiting,
            Phase::Loading => wit::Phase::Loading,
            Phase::Writing => wit::Phase::Writing,
            Phase::Done => wit::Phase::Done,
        }
    }

    fn state_in(s: wit::FlightState) -> Flight {
        Flight {
            phase: phase_in(s.phase),
            options: options_in(s.options),
            config: config_in(s.config),
            attempt: s.attempt,
            deadline_ms: s.deadline_ms,
            locked: s.locked,
            waited: s.waited,
            timed_out: s.timed_out,
            planned: s.planned.map(meta_in),
            stale: s.stale.map(meta_in),
            load_until_ms: s.load_until_ms,
            answered: s.answered,
            fence_known: s.fence_known,
            lock_until_ms: s.lock_until_ms,
            renew_at_ms: s.renew_at_ms,
            renew_sent_ms: s.renew_sent_ms,
        }
    }

    fn state_out(f: Flight) -> wit::FlightState {
        wit::FlightState {
            phase: phase_out(f.phase),
            options: options_out(f.options),
            config: config_out(f.config),
            attempt: f.attempt,
            deadline_ms: f.deadline_ms,
            locked: f.locked,
            waited: f.waited,
            timed_out: f.timed_out,
            planned: f.planned.map(meta_out),
            stale: f.stale.map(meta_out),
            load_until_ms: f.load_until_ms,
            answered: f.answered,
            fence_known: f.fence_known,
            lock_until_ms: f.lock_until_ms,
            renew_at_ms: f.renew_at_ms,
            renew_sent_ms: f.renew_sent_ms,
        }
    }

    fn event_in(e: wit::Event) -> Event {
        match e {
            wit::Event::L2Hit(meta) => Event::L2Hit(meta_in(meta)),
            wit::Event::L2Miss => Event::L2Miss,
            wit::Event::L2Stale(meta) => Event::L2Stale(meta_in(meta)),
            wit::Event::L2Failed => Event::L2Failed,
            wit::Event::LockAcquired => Event::LockAcquired,
            wit::Event::LockBusy(watching) => Event::LockBusy { watching },
            wit::Event::LockFailed => Event::LockFailed,
            wit::Event::Woken => Event::Woken,
            wit::Event::BudgetSpent => Event::BudgetSpent,
            wit::Event::Loaded(l) => Event::Loaded {
                len: l.len,
                cacheable: l.cacheable,
                expiry: l.expiry.map(options_in),
            },
            wit::Event::LoadFailed => Event::LoadFailed,
            wit::Event::LoadTimedOut => Event::LoadTimedOut,
            wit::Event::LoadSlow => Event::LoadSlow,
            wit::Event::LoadOverdue => Event::LoadOverdue,
            wit::Event::L2Written => Event::L2Written,
            wit::Event::L2WriteFailed => Event::L2WriteFailed,
            wit::Event::RenewDue => Event::RenewDue,
            wit::Event::Renewed => Event::Renewed,
            wit::Event::RenewRefused => Event::RenewRefused,
            wit::Event::RenewFailed => Event::RenewFailed,
            wit::Event::LoadBegan => Event::LoadBegan,
        }
    }

    fn action_out(a: Action) -> wit::Action {
        match a {
            Action::ReadL2 => wit::Action::ReadL2,
            Action::TryLock { ttl_ms } => wit::Action::TryLock(ttl_ms),
            Action::Wait { until_ms } => wit::Action::Wait(until_ms),
            Action::Load {
                until_ms,
                soft_until_ms,
                overdue_ms,
                renew_at_ms,
            } => wit::Action::Load(wit::LoadRequest {
                until_ms,
                soft_until_ms,
                overdue_ms,
                renew_at_ms,
            }),
            Action::RenewLock { ttl_ms, fenced } => wit::Action::RenewLock(wit::Renew { ttl_ms, fenced }),
            Action::AnswerStale { l1_until_ms } => wit::Action::AnswerStale(l1_until_ms),
            Action::KeepLoading { renew_at_ms } => wit::Action::KeepLoading(renew_at_ms),
            Action::AnswerTimedOut => wit::Action::AnswerTimedOut,
            Action::WriteL2 {
                header,
                store_ttl_ms,
                fenced,
                release,
            } => wit::Action::WriteL2(wit::Write {
                header: header.to_vec(),
                store_ttl_ms,
                fenced,
                release,
            }),
            Action::Finish {
                outcome,
                release,
                notify,
                l1_until_ms,
                refresh_at_ms,
                refresh_now,
            } => wit::Action::Finish(wit::Finish {
                outcome: match outcome {
                    Outcome::L2Hit { after_wait } => wit::Outcome::L2Hit(after_wait),
                    Outcome::Loaded { cached } => wit::Outcome::Loaded(cached),
                    Outcome::Lapsed => wit::Outcome::Lapsed,
                    Outcome::Degraded { timed_out } => wit::Outcome::Degraded(timed_out),
                    Outcome::LoaderFailed => wit::Outcome::LoaderFailed,
                    Outcome::Stale(cause) => wit::Outcome::Stale(match cause {
                        core::StaleCause::LoaderFailed => wit::StaleCause::LoaderFailed,
                        core::StaleCause::LoadTimedOut => wit::StaleCause::LoadTimedOut,
                        core::StaleCause::LockTimedOut => wit::StaleCause::LockTimedOut,
                        core::StaleCause::StoreFailed => wit::StaleCause::StoreFailed,
                    }),
                    Outcome::TimedOut => wit::Outcome::TimedOut,
                    Outcome::Skipped => wit::Outcome::Skipped,
                },
                release,
                notify,
                l1_until_ms,
                refresh_at_ms,
                refresh_now,
            }),
        }
    }

    impl wit::Guest for Component {
        fn start(
            key: String,
            options: types::EntryOptions,
            config: wit::FlightConfig,
            judged_ms: u64,
            now_ms: u64,
            l: types::Limits,
        ) -> Result<(wit::FlightState, wit::Action), types::Error> {
            let (flight, action) = Flight::start_judged(
                &key,
                options_in(options),
                config_in(config),
                judged_ms,
                now_ms,
                &limits(l),
            )
            .map_err(arg_error)?;
            Ok((state_out(flight), action_out(action)))
        }

        fn step(
            state: wit::FlightState,
            event: wit::Event,
            now_ms: u64,
            l: types::Limits,
        ) -> (wit::FlightState, wit::Action) {
            let mut flight = state_in(state);
            let action = flight.handle(event_in(event), now_ms, &limits(l));
            (state_out(flight), action_out(action))
        }

        fn abandon(state: wit::FlightState) -> bool {
            state_in(state).abandon()
        }

        fn l1_deadline(meta: types::EntryMeta, now_ms: u64, l1_ttl_ms: u64) -> u64 {
            core::l1_deadline(&meta_in(meta), now_ms, l1_ttl_ms)
        }
    }
}

mod lock {
    //! The `corral:lock/policy` export: conversions around `corral_core::lock`.

    use corral_core::lock::{self as core, Held};

    use super::bindings::corral::cache::types;
    use super::bindings::corral::lock::types::Held as WitHeld;
    use super::bindings::exports::corral::lock::policy as wit;
    use super::{Component, arg_error, limits};

    fn held_in(h: WitHeld) -> Held {
        Held {
            owner: h.owner,
            expires_at_ms: h.expires_at_ms,
            token: h.token,
        }
    }

    fn held_out(h: Held) -> WitHeld {
        WitHeld {
            owner: h.owner,
            expires_at_ms: h.expires_at_ms,
            token: h.token,
        }
    }

    impl wit::Guest for Component {
        fn check_request(key: String, ttl_ms: u64, l: types::Limits) -> Result<(), types::Error> {
            core::check_request(&key, ttl_ms, &limits(l)).map_err(arg_error)
        }

        fn try_lock(current: Option<WitHeld>, owner: String, ttl_ms: u64, now_ms: u64) -> Option<WitHeld> {
            core::try_lock(current.map(held_in).as_ref(), &owner, ttl_ms, now_ms).map(held_out)
        }

        fn release(current: Option<WitHeld>, owner: String, now_ms: u64) -> Option<WitHeld> {
            core::release(current.map(held_in).as_ref(), &owner, now_ms).map(held_out)
        }

        fn is_expired(current: Option<WitHeld>, now_ms: u64) -> bool {
            core::is_expired(current.map(held_in).as_ref(), now_ms)
        }

        fn is_locked_by(current: Option<WitHeld>, owner: String, now_ms: u64) -> bool {
            core::is_locked_by(current.map(held_in).as_ref(), &owner, now_ms)
        }

        fn sweepable(entry: WitHeld, now_ms: u64) -> bool {
            core::sweepable(&held_in(entry), now_ms)
        }

        fn sweep_interval_ms() -> u64 {
            core::SWEEP_INTERVAL_MS
        }

        fn next_try(attempt: u32, now_ms: u64, deadline_ms: u64) -> Option<u64> {
            core::next_try(attempt, now_ms, deadline_ms)
        }

        fn decide(acquired: u32, servers: u32, ttl_ms: u64, elapsed_ms: u64) -> Option<u64> {
            core::decide(acquired, servers, ttl_ms, elapsed_ms)
        }

        fn orphan_window_ms(ttl_ms: u64) -> u64 {
            core::orphan_window_ms(ttl_ms)
        }

        fn fair_waiter(started_us: u64, token: String) -> String {
            core::fair_waiter(started_us, &token)
        }

        fn has_quorum(count: u32, servers: u32) -> bool {
            core::has_quorum(count, servers)
        }

        fn renew_after_ms(ttl_ms: u64) -> u64 {
            core::renew_after_ms(ttl_ms)
        }

        fn fencing_token(per_server: Vec<u64>) -> u64 {
            core::fencing_token(&per_server)
        }

        fn scripts() -> wit::LockScripts {
            use corral_core::script;
            wit::LockScripts {
                acquire: script::LOCK_ACQUIRE.to_string(),
                acquire_fair: script::LOCK_ACQUIRE_FAIR.to_string(),
                release: script::LOCK_RELEASE.to_string(),
                extend: script::LOCK_EXTEND.to_string(),
            }
        }
    }
}
