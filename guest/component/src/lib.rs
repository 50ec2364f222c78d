//! The Corral WebAssembly component: `corral-core` behind the WIT contract in `wit/`.
//!
//! This crate holds the project's only `generate!`/`export!`. Every export converts its
//! arguments, asks `corral-core`, and converts the answer back: no decision is made
//! here. It is built for `wasm32-wasip2` by `host/build.rs`; on any other target it is
//! empty (a native cdylib that exports WIT names cannot link).

#![cfg(target_arch = "wasm32")]

use corral_core::{Limits, envelope, expiry, policy};

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

use bindings::corral::cache::types;
use bindings::exports::corral::cache::policy as wit;

struct Component;

fn limits(l: types::Limits) -> Limits {
    Limits {
        max_key_bytes: l.max_key_bytes,
        max_value_bytes: l.max_value_bytes,
        default_sliding_ms: l.default_sliding_ms,
    }
}

fn meta_in(m: types::EntryMeta) -> corral_core::EntryMeta {
    corral_core::EntryMeta {
        absolute_ms: m.absolute_ms,
        sliding_ms: m.sliding_ms,
        expires_at_ms: m.expires_at_ms,
    }
}

fn meta_out(m: corral_core::EntryMeta) -> types::EntryMeta {
    types::EntryMeta {
        absolute_ms: m.absolute_ms,
        sliding_ms: m.sliding_ms,
        expires_at_ms: m.expires_at_ms,
    }
}

fn arg_error(e: corral_core::ArgError) -> types::Error {
    types::Error::InvalidArgument(types::ArgError {
        name: e.arg.name().to_string(),
        reason: e.reason,
    })
}

impl wit::Guest for Component {
    fn check_limits(l: types::Limits) -> Result<(), types::Error> {
        limits(l).check().map_err(arg_error)
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
        let options = corral_core::EntryOptions {
            absolute_ms: options.absolute_ms,
            relative_ms: options.relative_ms,
            sliding_ms: options.sliding_ms,
        };
        let plan =
            policy::plan_set(&key, value_len, &options, now_ms, &limits(l)).map_err(arg_error)?;
        Ok(wit::Plan {
            meta: meta_out(plan.meta),
            header: plan.header.to_vec(),
            store_ttl_ms: plan.store_ttl_ms,
        })
    }

    fn check(meta: types::EntryMeta, now_ms: u64) -> wit::Freshness {
        match expiry::check(&meta_in(meta), now_ms) {
            expiry::Freshness::Fresh { meta, moved } => {
                wit::Freshness::Fresh((meta_out(meta), moved))
            }
            expiry::Freshness::Expired => wit::Freshness::Expired,
        }
    }

    fn read(head: Vec<u8>, total_len: u64, now_ms: u64, l: types::Limits) -> wit::ReadOutcome {
        match policy::read(&head, total_len, now_ms, &limits(l)) {
            policy::ReadOutcome::Fresh(hit) => wit::ReadOutcome::Fresh(wit::Hit {
                meta: meta_out(hit.meta),
                value_offset: hit.value_offset as u32,
                new_header: hit.new_header.map(|h| h.to_vec()),
                store_ttl_ms: hit.store_ttl_ms,
            }),
            policy::ReadOutcome::Expired => wit::ReadOutcome::Expired,
            policy::ReadOutcome::Corrupt(c) => wit::ReadOutcome::Corrupt(c.to_string()),
        }
    }

    fn decode(
        head: Vec<u8>,
        total_len: u64,
        l: types::Limits,
    ) -> Result<wit::Decoded, types::Error> {
        let d = envelope::decode_header(&head, total_len, &limits(l))
            .map_err(|c| types::Error::Corrupt(c.to_string()))?;
        Ok(wit::Decoded {
            meta: meta_out(d.meta),
            value_offset: d.value_offset as u32,
            value_len: d.value_len as u32,
        })
    }

    fn encode_header(meta: types::EntryMeta, value_len: u64) -> Vec<u8> {
        envelope::encode_header(&meta_in(meta), value_len).to_vec()
    }

    fn header_len() -> u32 {
        envelope::HEADER_LEN as u32
    }

    fn redis_read_script() -> String {
        corral_core::script::READ_AND_TOUCH.to_string()
    }

    fn redis_delete_if_equal_script() -> String {
        corral_core::script::DELETE_IF_EQUAL.to_string()
    }

    fn store_ttl_grace_ms() -> u64 {
        expiry::STORE_TTL_GRACE_MS
    }
}
