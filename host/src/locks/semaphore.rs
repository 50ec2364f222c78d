//! The local keyed semaphore (seed 000): one permit per key, shared by reference count.
//! Dropping a [`KeyPermit`] releases the permit (if held) and the reference exactly
//! once, and removes the key's entry when nobody holds or awaits it: the map never grows
//! with the number of distinct keys ever seen.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A map from key to a semaphore of one permit.
#[derive(Clone, Default)]
pub struct KeyedSemaphore {
    map: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
}

impl fmt::Debug for KeyedSemaphore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedSemaphore")
            .field("keys", &self.len())
            .finish()
    }
}

/// A claim on one key's permit; see [`KeyPermit::acquired`].
#[must_use]
pub struct KeyPermit {
    owner: KeyedSemaphore,
    key: String,
    semaphore: Option<Arc<Semaphore>>,
    permit: Option<OwnedSemaphorePermit>,
}

impl fmt::Debug for KeyPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyPermit")
            .field("key", &self.key)
            .field("acquired", &self.acquired())
            .finish()
    }
}

impl KeyPermit {
    /// Whether the permit was had within the timeout.
    pub fn acquired(&self) -> bool {
        self.permit.is_some()
    }
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        drop(self.permit.take());
        let Some(semaphore) = self.semaphore.take() else {
            return;
        };
        let mut map = self.owner.map.lock();
        // Ours and the map's are the last two references, and the permit is free.
        if Arc::strong_count(&semaphore) == 2 && semaphore.available_permits() == 1 {
            map.remove(&self.key);
        }
    }
}

impl KeyedSemaphore {
    /// A new, empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes `key`'s permit, waiting at most `timeout`. The returned claim says whether
    /// it was had; dropping it releases whatever it holds.
    pub async fn acquire(&self, key: &str, timeout: Duration) -> KeyPermit {
        let semaphore = self
            .map
            .lock()
            .entry(key.to_owned())
            .or_insert_with(|| Arc::new(Semaphore::new(1)))
            .clone();
        let permit = tokio::time::timeout(timeout, semaphore.clone().acquire_owned())
            .await
            .ok()
            .and_then(Result::ok);
        KeyPermit {
            owner: self.clone(),
            key: key.to_owned(),
            semaphore: Some(semaphore),
            permit,
        }
    }

    /// Keys with a holder or a waiter.
    pub fn len(&self) -> usize {
        self.map.lock().len()
    }

    /// Whether no key has a holder or a waiter.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn one_holder_per_key_a_timeout_says_so_and_the_map_empties() {
        let sem = KeyedSemaphore::new();
        let a = sem.acquire("k", Duration::from_secs(1)).await;
        assert!(a.acquired());
        let b = sem.acquire("k", Duration::from_millis(10)).await;
        assert!(!b.acquired(), "the permit is held");
        let other = sem.acquire("other", Duration::from_millis(10)).await;
        assert!(other.acquired(), "keys are independent");
        drop(b);
        assert_eq!(sem.len(), 2);
        drop(a);
        drop(other);
        assert!(sem.is_empty(), "no entry outlives its last holder");
        for i in 0..100 {
            drop(sem.acquire(&format!("k{i}"), Duration::from_secs(1)).await);
        }
        assert!(sem.is_empty(), "the map does not grow with distinct keys");
    }

    #[tokio::test]
    async fn a_waiter_gets_the_permit_when_the_holder_drops_it() {
        let sem = KeyedSemaphore::new();
        let a = sem.acquire("k", Duration::from_secs(1)).await;
        let waiter = {
            let sem = sem.clone();
            tokio::spawn(async move { sem.acquire("k", Duration::from_secs(5)).await.acquired() })
        };
        tokio::task::yield_now().await;
        drop(a);
        assert!(waiter.await.unwrap());
        assert!(sem.is_empty());
    }
}
