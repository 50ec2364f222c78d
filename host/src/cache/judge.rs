//! A get-or-set's options are judged the same way whether its key is warm or cold: a
//! bad option is an argument error even when L1 could answer at once (contract §5).
//!
//! The judgement is the guest's (the flight's `start`, and `check-tags`), made on the
//! hit path too. So that an L1 hit does not pay a guest call each time, each worker
//! thread remembers the last few option sets the guest accepted. Only options without
//! an absolute point are remembered: `expiry::plan` judges those the same at every
//! moment (every duration is at most 100 years, `LONGEST_DURATION_MS`, whatever the
//! clock says), and nothing in the verdict depends on the cache it was made for (its
//! defaults were judged when it was built), while an absolute point turns bad once it
//! passes.

use std::cell::RefCell;
use std::sync::Arc;

use super::Corral;
use super::load::LoadOptions;
use crate::Result;
use crate::options::EntryOptions;

/// How many accepted option sets each thread remembers.
const REMEMBERED: usize = 4;

/// What the guest's verdict on a get-or-set's options depends on (beyond the key).
#[derive(Clone, PartialEq, Eq)]
struct Judged {
    entry: EntryOptions,
    hard_timeout_ms: Option<u64>,
    soft_timeout_ms: Option<u64>,
    eager_refresh_permille: Option<u32>,
    tags: Arc<[String]>,
}

impl Judged {
    fn of(options: &LoadOptions) -> Judged {
        Judged {
            entry: options.entry,
            hard_timeout_ms: options.hard_timeout_ms,
            soft_timeout_ms: options.soft_timeout_ms,
            eager_refresh_permille: options.eager_refresh_permille,
            tags: options.tags.clone(),
        }
    }

    /// Whether `options` are these (compared in place: the hit path clones nothing).
    fn is(&self, options: &LoadOptions) -> bool {
        self.entry == options.entry
            && self.hard_timeout_ms == options.hard_timeout_ms
            && self.soft_timeout_ms == options.soft_timeout_ms
            && self.eager_refresh_permille == options.eager_refresh_permille
            && (Arc::ptr_eq(&self.tags, &options.tags) || self.tags == options.tags)
    }
}

/// Whether a verdict on `options` may be remembered: an absolute point is good until it
/// passes, so it is judged on every call.
fn rememberable(options: &LoadOptions) -> bool {
    options.entry.absolute_ms.is_none()
}

thread_local! {
    static ACCEPTED: RefCell<(usize, [Option<Judged>; REMEMBERED])> =
        const { RefCell::new((0, [const { None }; REMEMBERED])) };
}

impl Corral {
    /// Judges `options` for a get-or-set of `key` now, as a cold call would, before any
    /// tier is asked: the same answer whether the key is in L1 or not. The moment is
    /// kept in `options` (`judged_ms`): every flight of the call starts from this verdict.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidArgument`](crate::ErrorKind::InvalidArgument) naming the
    /// option at fault.
    pub(super) fn judge(&self, key: &str, options: &mut LoadOptions) -> Result<()> {
        let now = self.inner.clock.now_ms();
        options.judged_ms = Some(now);
        let remember = rememberable(options);
        if remember && ACCEPTED.with(|a| a.borrow().1.iter().flatten().any(|j| j.is(options))) {
            return Ok(());
        }
        let inner = &*self.inner;
        let config = self.flight_config(options, true);
        inner.policy.flight_start(key, &options.entry, config, now, now)?;
        if !options.tags.is_empty() {
            inner.policy.check_tags(&options.tags)?;
        }
        if remember {
            ACCEPTED.with(|a| {
                let (next, slots) = &mut *a.borrow_mut();
                slots[*next] = Some(Judged::of(options));
                *next = (*next + 1) % REMEMBERED;
            });
        }
        Ok(())
    }
}
