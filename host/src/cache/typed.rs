//! Typed values: a serde JSON codec layered on the byte API.

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::Corral;
use super::load::LoadOptions;
use crate::options::EntryOptions;
use crate::{Error, ErrorKind, Result};

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|e| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("`value` cannot be encoded as JSON: {e}"),
        )
        .with_source(e)
    })
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
        let bytes = self
            .get_or_set(key, options, || async move {
                let value = loader().await.map_err(Into::into)?;
                serde_json::to_vec(&value)
                    .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)
            })
            .await?;
        decode(key, &bytes)
    }
}
