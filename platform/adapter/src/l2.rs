//! The `l2` import on a `wasi:keyvalue` bucket: plain reads and writes of records, and
//! every conditional change as a compare-and-swap over what was read ([`change`]).

use std::cell::OnceCell;

use corral_core::kv;

use crate::bindings::exports::corral::cache::l2;
use crate::bindings::exports::corral::cache::types::Error;
#[cfg(not(feature = "draft"))]
use crate::bindings::wasi::keyvalue::atomics::{self, Cas, CasError};
use crate::bindings::wasi::keyvalue::store::{self, Bucket};
use crate::{Adapter, now_ms};

/// The environment variable naming the bucket.
const STORE_VAR: &str = "CORRAL_KEYVALUE_STORE";
/// The bucket opened when it names none: Spin's default store label.
#[cfg(not(feature = "draft"))]
const DEFAULT_STORE: &str = "default";
/// The bucket opened when it names none: wasmtime's in-memory store has only `""`.
#[cfg(feature = "draft")]
const DEFAULT_STORE: &str = "";

thread_local! {
    static BUCKET: OnceCell<Bucket> = const { OnceCell::new() };
}

fn store_error(e: store::Error) -> Error {
    Error::Unavailable(match e {
        store::Error::NoSuchStore => "the key-value store does not exist".to_owned(),
        store::Error::AccessDenied => "the key-value store refused access".to_owned(),
        store::Error::Other(text) => format!("the key-value store failed: {text}"),
    })
}

/// Runs `f` on this instance's bucket, opened at its first use (a failed open is tried
/// again at the next use).
pub(crate) fn with_bucket<T>(f: impl FnOnce(&Bucket) -> Result<T, Error>) -> Result<T, Error> {
    BUCKET.with(|cell| {
        if cell.get().is_none() {
            let name = std::env::var(STORE_VAR).unwrap_or_else(|_| DEFAULT_STORE.to_owned());
            let _ = cell.set(store::open(&name).map_err(store_error)?);
        }
        match cell.get() {
            Some(bucket) => f(bucket),
            None => Err(Error::Unavailable("the key-value store is not open".to_owned())),
        }
    })
}

/// Changes what `name` holds in one compare-and-swap: `decide` sees what it holds now
/// (`kv::live`) and says what record to write, if any, and what to answer. When the key
/// changed between the read and the swap, it is read and decided again, up to the
/// core's compare-and-swap tries.
#[cfg(not(feature = "draft"))]
pub(crate) fn change<T>(
    name: &str,
    mut decide: impl FnMut(Option<&[u8]>) -> (Option<Vec<u8>>, T),
) -> Result<T, Error> {
    for _ in 0..corral_core::Settings::DEFAULT.cas_tries {
        let (cas, current) = with_bucket(|bucket| {
            let cas = Cas::new(bucket, name).map_err(store_error)?;
            let current = cas.current().map_err(store_error)?;
            Ok((cas, current))
        })?;
        let live = current.as_deref().and_then(|stored| kv::live(stored, now_ms()));
        let (write, answer) = decide(live);
        let Some(record) = write else {
            return Ok(answer);
        };
        match atomics::swap(cas, &record) {
            Ok(()) => return Ok(answer),
            Err(CasError::CasFailed(_)) => continue,
            Err(CasError::StoreError(e)) => return Err(store_error(e)),
        }
    }
    Err(Error::Unavailable(format!("{name:?} kept changing")))
}

/// Changes what `name` holds without compare-and-swap (`draft`): a read, then a write.
/// Another instance's write between the two is lost; only what may be lost (a removal's
/// tombstone, a lock) goes this way, never a value a read could be fenced on.
#[cfg(feature = "draft")]
pub(crate) fn change<T>(
    name: &str,
    decide: impl FnOnce(Option<&[u8]>) -> (Option<Vec<u8>>, T),
) -> Result<T, Error> {
    with_bucket(|bucket| {
        let current = bucket.get(name).map_err(store_error)?;
        let live = current.as_deref().and_then(|stored| kv::live(stored, now_ms()));
        let (write, answer) = decide(live);
        if let Some(record) = write {
            bucket.set(name, &record).map_err(store_error)?;
        }
        Ok(answer)
    })
}

/// Whether a change that must land only over what was read can be made: not without
/// compare-and-swap (`draft`), where it is refused (a touch or a conditional removal is
/// not made; a fenced write fails).
const CONDITIONAL: bool = cfg!(not(feature = "draft"));

/// A fresh random owner token for the get-or-set lock: 128 bits from `wasi:random/random`
/// (which hosts must not make deterministic).
fn owner_token() -> String {
    crate::bindings::wasi::random::random::get_random_bytes(16)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

impl l2::Guest for Adapter {
    fn get(name: String) -> Result<Option<Vec<u8>>, Error> {
        let stored = with_bucket(|bucket| bucket.get(&name).map_err(store_error))?;
        let now = now_ms();
        Ok(stored.and_then(|stored: Vec<u8>| kv::live(&stored, now).map(|v| v.to_vec())))
    }

    /// One `get` per name: `wasi:keyvalue/batch` is not among the imports every host
    /// of the draft gives.
    fn get_many(names: Vec<String>) -> Vec<Result<Option<Vec<u8>>, Error>> {
        names.into_iter().map(Self::get).collect()
    }

    fn set(name: String, value: Vec<u8>, ttl_ms: u64) -> Result<(), Error> {
        let record = kv::record(kv::until(now_ms(), ttl_ms), &value);
        with_bucket(|bucket| bucket.set(&name, &record).map_err(store_error))
    }

    fn delete(name: String) -> Result<bool, Error> {
        change(&name, |live| (live.map(|_| kv::tombstone()), live.is_some()))
    }

    fn delete_if_equal(name: String, expected: Vec<u8>) -> Result<bool, Error> {
        if !CONDITIONAL {
            return Ok(false);
        }
        change(&name, |live| {
            let equal = live == Some(&expected[..]);
            (equal.then(kv::tombstone), equal)
        })
    }

    fn replace_if_equal(name: String, expected: Vec<u8>, value: Vec<u8>, ttl_ms: u64) -> Result<bool, Error> {
        if !CONDITIONAL {
            return Ok(false);
        }
        change(&name, |live| {
            let equal = live == Some(&expected[..]);
            (
                equal.then(|| kv::record(kv::until(now_ms(), ttl_ms), &value)),
                equal,
            )
        })
    }

    fn swap(name: String, value: Vec<u8>, ttl_ms: u64) -> Result<Option<Vec<u8>>, Error> {
        change(&name, |live| {
            let record = kv::record(kv::until(now_ms(), ttl_ms), &value);
            (Some(record), live.map(<[u8]>::to_vec))
        })
    }

    /// Without compare-and-swap (`draft`): an entry's fenced write (a load's fill) is
    /// not written, and says it landed when the store still holds what the flight read,
    /// so the value stays in this instance's L1 only (never over a newer write the store
    /// holds, never in the store where it could land over one); any other (a tag's
    /// moments, the generation) fails, saying why, instead of being lost.
    fn set_if(name: String, expected: Option<Vec<u8>>, value: Vec<u8>, ttl_ms: u64) -> Result<bool, Error> {
        if !CONDITIONAL {
            if corral_core::names::kind_of(&name) == Some(corral_core::names::Kind::Entry) {
                return Ok(Self::get(name)? == expected);
            }
            return Err(Error::Unavailable(
                "wasi:keyvalue@0.2.0-draft has no compare-and-swap: a write made only over what was read cannot be made"
                    .to_owned(),
            ));
        }
        change(&name, |live| {
            let equal = live == expected.as_deref();
            (
                equal.then(|| kv::record(kv::until(now_ms(), ttl_ms), &value)),
                equal,
            )
        })
    }

    /// Compare-and-swap covers one key: an entry and its lock cannot change in one step
    /// here, so the guest writes with `set-if`, then releases.
    fn fill_releasing(
        _name: String,
        _expected: Option<Vec<u8>>,
        _value: Vec<u8>,
        _ttl_ms: u64,
        _lock: String,
        _owner: String,
        _key: String,
    ) -> Result<Option<l2::Filled>, Error> {
        Ok(None)
    }

    fn try_lock(name: String, ttl_ms: u64) -> Result<Option<String>, Error> {
        let owner = owner_token();
        change(&name, |live| match live {
            Some(_) => (None, None),
            None => {
                let record = kv::record(kv::until(now_ms(), ttl_ms), owner.as_bytes());
                (Some(record), Some(owner.clone()))
            }
        })
    }

    fn release_lock(name: String, owner: String) -> Result<bool, Error> {
        change(&name, |live| {
            let ours = live == Some(owner.as_bytes());
            (ours.then(kv::tombstone), ours)
        })
    }

    /// No host offers a watcher: the wait ends at `until-ms`, the flight machine's next
    /// look (its backoff, 50 ms doubling to 1 s), and the flight reads again.
    /// Sleeps to `until_ms`: `bound` is not kept here, so the budget never runs out.
    fn wait_landing(_key: String, until_ms: u64) -> bool {
        let left = until_ms.saturating_sub(now_ms());
        std::thread::sleep(std::time::Duration::from_millis(left));
        false
    }

    fn announce_landing(_key: String) {}

    fn announce_invalidation(_message: String) {}

    fn bound(_ms: u64) {}
}
