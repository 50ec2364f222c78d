//! Typed values: a serde JSON codec layered on the byte API.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Corral;
use super::load::LoadOptions;
use crate::options::EntryOptions;
use crate::{Error, ErrorKind, Result};

/// Decoded typed values, each with the very bytes it was decoded from: a value is
/// reused only while L1 hands out those same bytes (the same allocation, kept alive
/// here, so it cannot be another value's), so it is never staler than L1 itself.
#[derive(Clone)]
pub(crate) struct Decoded(Option<moka::sync::Cache<String, DecodedValue>>);

/// A decoded value and the bytes it was decoded from.
type DecodedValue = (Bytes, Arc<dyn Any + Send + Sync>);

impl fmt::Debug for Decoded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Decoded")
    }
}

impl Decoded {
    /// As large as L1 (none when L1 is off), for at most the L1 TTL.
    pub(crate) fn new(capacity: u64, ttl_ms: u64) -> Self {
        Decoded((capacity > 0).then(|| {
            moka::sync::Cache::builder()
                .max_capacity(capacity)
                .time_to_live(Duration::from_millis(ttl_ms.max(1)))
                .build()
        }))
    }

    fn get<T: Send + Sync + 'static>(&self, key: &str, bytes: &Bytes) -> Option<Arc<T>> {
        let (held, value) = self.0.as_ref()?.get(key)?;
        (held.as_ptr() == bytes.as_ptr() && held.len() == bytes.len())
            .then(|| value.downcast::<T>().ok())
            .flatten()
    }

    fn put<T: Send + Sync + 'static>(&self, key: &str, bytes: Bytes, value: Arc<T>) {
        if let Some(cache) = &self.0 {
            cache.insert(key.to_owned(), (bytes, value));
        }
    }
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("`value` cannot be encoded as JSON: {e}"),
        )
        .with_source(e)
    })
}

/// What a typed `loader` loads, as JSON, its verdict (`should_cache`) noted in
/// `verdict`.
async fn typed_value<T, P, F, Fut, E>(
    loader: F,
    verdict: &AtomicBool,
    should_cache: &P,
) -> std::result::Result<Vec<u8>, Box<dyn std::error::Error + Send + Sync>>
where
    T: Serialize,
    P: Fn(&T) -> bool,
    F: FnOnce() -> Fut,
    Fut: Future<Output = std::result::Result<T, E>>,
    E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    let value = loader().await.map_err(Into::into)?;
    verdict.store(should_cache(&value), Ordering::Release);
    Ok(serde_json::to_vec(&value)?)
}

fn decode<T: DeserializeOwned>(key: &str, bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|e| {
        Error::new(
            ErrorKind::Corrupt,
            format!("the value under {key:?} is not the JSON this type expects: {e}"),
        )
        .with_source(e)
    })
}

impl Corral {
    /// [`get`](Corral::get), decoding the value from JSON.
    ///
    /// # Errors
    /// As [`get`](Corral::get); [`ErrorKind::Corrupt`] when the value is not `T`'s JSON.
    pub async fn get_json<T: DeserializeOwned>(&self, key: &str) -> Result<Option<T>> {
        self.get(key).await?.map(|b| decode(key, &b)).transpose()
    }

    /// [`set`](Corral::set), encoding the value as JSON.
    ///
    /// # Errors
    /// As [`set`](Corral::set).
    pub async fn set_json<T: Serialize>(&self, key: &str, value: &T, options: EntryOptions) -> Result<()> {
        self.set(key, encode(value)?, options).await
    }

    /// [`get_or_set`](Corral::get_or_set) with a typed loader; values travel as JSON.
    ///
    /// A loaded `None` (anything that is JSON `null`) is returned but not cached, unless
    /// the options ask for negative caching ([`LoadOptions::cache_none_for`]), which
    /// caches it for its own, usually short, TTL. A key that may hold such a `null` (from
    /// here, or from [`get_or_set_many_json`](Corral::get_or_set_many_json)'s negative
    /// caching) is read as an `Option`: a `T` that cannot hold `null` reads it as
    /// [`ErrorKind::Corrupt`].
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) -> corral::Result<()> {
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct User { name: String }
    /// let user: User = cache
    ///     .get_or_set_json("user:42", corral::EntryOptions::new(), || async {
    ///         Ok::<_, std::io::Error>(User { name: "Ada".into() })
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`get_or_set`](Corral::get_or_set); [`ErrorKind::Corrupt`] when a cached value
    /// is not `T`'s JSON.
    pub async fn get_or_set_json<T, F, Fut, E>(
        &self,
        key: &str,
        options: impl Into<LoadOptions>,
        loader: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<T, E>>,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        self.get_or_set_json_if(key, options, |_: &T| true, loader).await
    }

    /// [`get_or_set_json`](Corral::get_or_set_json), caching a loaded value only when
    /// `should_cache` accepts it (it sees the value, not its bytes); a rejected value is
    /// still returned to the caller and its coalesced followers.
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) -> corral::Result<()> {
    /// # #[derive(serde::Serialize, serde::Deserialize)] struct Page { partial: bool }
    /// let page: Page = cache
    ///     .get_or_set_json_if("page:1", corral::LoadOptions::relative(std::time::Duration::from_secs(60)),
    ///         |p: &Page| !p.partial,
    ///         || async { Ok::<_, std::io::Error>(Page { partial: true }) })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`get_or_set_json`](Corral::get_or_set_json).
    pub async fn get_or_set_json_if<T, P, F, Fut, E>(
        &self,
        key: &str,
        options: impl Into<LoadOptions>,
        should_cache: P,
        loader: F,
    ) -> Result<T>
    where
        T: Serialize + DeserializeOwned,
        P: Fn(&T) -> bool + Send + Sync + 'static,
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<T, E>>,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        // The typed verdict, taken where the value is at hand, for the byte-level
        // predicate the driver asks once the value is encoded.
        let verdict = Arc::new(AtomicBool::new(true));
        let mut options = options.into();
        options.typed = true;
        let options = {
            let verdict = verdict.clone();
            options.and_should_cache(move |_| verdict.load(Ordering::Acquire))
        };
        let bytes = self
            .get_or_set(key, options, || typed_value(loader, &verdict, &should_cache))
            .await?;
        decode(key, &bytes)
    }

    /// [`get_or_set_many`](Corral::get_or_set_many) with a typed loader; values travel
    /// as JSON. A key the loader leaves out is a `None`: absent, as for
    /// [`get_or_set_many`](Corral::get_or_set_many) (nothing cached, and a single-key
    /// follower loads it itself), unless the options ask for negative caching
    /// ([`LoadOptions::cache_none_for`]): then JSON `null` is cached for its TTL, as a
    /// loaded `None` is by [`get_or_set_json`](Corral::get_or_set_json), and the key is
    /// read as an `Option` everywhere (`get_or_set_json::<Option<T>>`). As for the
    /// untyped call, a left-out key is a failed load for fail-safe: a stale copy, if one
    /// is kept, is served.
    ///
    /// ```no_run
    /// # async fn demo(cache: corral::Corral) -> corral::Result<()> {
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct Product { name: String }
    /// let ids = vec!["product:1".to_string(), "product:2".to_string()];
    /// let products: Vec<corral::Result<Option<Product>>> = cache
    ///     .get_or_set_many_json(&ids, corral::EntryOptions::new(), |keys| async move {
    ///         // SELECT ... WHERE id IN (keys)
    ///         let rows = keys.into_iter().map(|k| (k.clone(), Product { name: k }));
    ///         Ok::<_, std::io::Error>(rows.collect::<Vec<_>>())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`get_or_set_many`](Corral::get_or_set_many); per key,
    /// [`ErrorKind::Corrupt`] when a cached value is not `T`'s JSON, and
    /// [`ErrorKind::Loader`] when the value the loader gave it cannot be encoded as JSON
    /// (that key alone, as [`get_or_set_json`](Corral::get_or_set_json) fails: nothing
    /// is cached for it).
    pub async fn get_or_set_many_json<T, K, L, Fut, I, E>(
        &self,
        keys: impl IntoIterator<Item = K>,
        options: impl Into<LoadOptions>,
        loader: L,
    ) -> Result<Vec<Result<Option<T>>>>
    where
        T: Serialize + DeserializeOwned,
        K: AsRef<str>,
        L: Fn(Vec<String>) -> Fut,
        Fut: Future<Output = std::result::Result<I, E>>,
        I: IntoIterator<Item = (String, T)>,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let keys: Vec<String> = keys.into_iter().map(|k| k.as_ref().to_owned()).collect();
        let mut options = options.into();
        options.typed = true;
        let negative = options.none_ttl.is_some();
        let loader = &loader;
        // A value that cannot be encoded fails its own key, as one key's typed load does,
        // not the call's: it is left out (nothing cached, not even null: a failed load,
        // for fail-safe too) and answered with its error.
        let unencodable: parking_lot::Mutex<HashMap<String, Error>> = Default::default();
        let unencodable = &unencodable;
        let answers = self
            .get_or_set_many(&keys, options, |asked: Vec<String>| async move {
                let mut values: HashMap<String, Vec<u8>> = HashMap::new();
                for (key, value) in loader(asked.clone()).await.map_err(Into::into)? {
                    match serde_json::to_vec(&value) {
                        Ok(json) => {
                            values.insert(key, json);
                        }
                        Err(e) => {
                            values.remove(&key);
                            unencodable.lock().insert(key, Error::loader(Box::new(e)));
                        }
                    }
                }
                // A key left out is absent (its followers elsewhere load it themselves),
                // unless negative caching is asked for: then it is JSON null, which the
                // typed verdict caches for its own TTL.
                let unencodable = unencodable.lock();
                let all: Vec<(String, Vec<u8>)> = asked
                    .into_iter()
                    .filter_map(|key| match values.remove(&key) {
                        Some(value) => Some((key, value)),
                        None if unencodable.contains_key(&key) => None,
                        None => negative.then(|| (key, b"null".to_vec())),
                    })
                    .collect();
                Ok::<_, Box<dyn std::error::Error + Send + Sync>>(all)
            })
            .await?;
        let unencodable = unencodable.lock();
        Ok(keys
            .iter()
            .zip(answers)
            .map(|(key, answer)| match (answer?, unencodable.get(key)) {
                // A stale copy fail-safe served in place of the failed load.
                (Some(bytes), _) => decode::<Option<T>>(key, &bytes),
                (None, Some(e)) => Err(e.clone()),
                (None, None) => Ok(None),
            })
            .collect())
    }

    /// [`get_or_set_json`](Corral::get_or_set_json), sharing the decoded value: an L1
    /// hit returns the value decoded the last time, without parsing JSON again, for as
    /// long as L1 holds the very bytes it came from.
    ///
    /// # Errors
    /// As [`get_or_set_json`](Corral::get_or_set_json).
    pub async fn get_or_set_json_shared<T, F, Fut, E>(
        &self,
        key: &str,
        options: impl Into<LoadOptions>,
        loader: F,
    ) -> Result<Arc<T>>
    where
        T: Serialize + DeserializeOwned + Send + Sync + 'static,
        F: FnOnce() -> Fut,
        Fut: Future<Output = std::result::Result<T, E>>,
        E: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
    {
        let mut options = options.into();
        options.typed = true;
        let bytes = self
            .get_or_set(key, options, || async move {
                let value = loader().await.map_err(Into::into)?;
                serde_json::to_vec(&value)
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
            })
            .await?;
        if let Some(value) = self.inner.decoded.get::<T>(key, &bytes) {
            return Ok(value);
        }
        let value = Arc::new(decode::<T>(key, &bytes)?);
        self.inner.decoded.put(key, bytes, value.clone());
        Ok(value)
    }
}
