//! A get-or-set in two phases (`cache.begin`, then the end of its `load`): the caller
//! loads the value with its own origin between the phases, so no import calls back into
//! it and an application composes with the component without a cycle.
//!
//! The loads this instance's callers hold are kept here, by key: a caller that begins a
//! key whose load another caller of the instance holds follows that load (`wait`)
//! instead of blocking the instance on the process's flight registry, which that load's
//! own end could never reach. Followers in other instances meet through the registry.
//! As there (contract §5.3), a follower takes the load's outcome only if its key is as
//! it was when the load began; else, once that load ended, it leads one of its own.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use corral_core::Settings;
use corral_core::flight::{Flight, FlightConfig};

use super::driver::{Driver, Step};
use super::{check_tags, l1_entry, locate, locate_for_flight, now_ms, same_copy, settings};
use crate::bindings::corral::cache::flights::{self, Joined};
use crate::bindings::corral::cache::{l1, l2, types};
use crate::bindings::exports::corral::cache::cache::{self as wcache, Begun, Followed};
use crate::{arg_error, options_in};

/// What a load's followers in this instance learn of it.
struct Shared {
    /// The key's L1 ticket when the load's flight began.
    ticket: l1::L1Ticket,
    /// How it ended.
    outcome: RefCell<Option<Result<Vec<u8>, types::Error>>>,
    /// It was dropped without an end.
    dropped: RefCell<bool>,
}

thread_local! {
    /// The loads this instance's callers hold as their process's leader of a key.
    static OPEN: RefCell<HashMap<String, Rc<Shared>>> = RefCell::new(HashMap::new());
}

/// The load of `key` a caller of this instance holds, if any.
fn open(key: &str) -> Option<Rc<Shared>> {
    OPEN.with(|open| open.borrow().get(key).cloned())
}

/// What a get-or-set was asked with: what a follower needs to lead in a dropped load's
/// place, and a hit to start its eager refresh.
#[derive(Clone)]
struct Request {
    key: String,
    options: types::EntryOptions,
    bypass: bool,
    tags: Vec<String>,
}

/// A load the caller holds: the flight stopped at its load.
pub(crate) struct Loading {
    /// Taken when the load ends; still here when it is dropped without an end.
    driver: RefCell<Option<Driver>>,
    /// Its followers in this instance, when it leads the process's flight of its key.
    shared: Option<Rc<Shared>>,
}

impl Loading {
    /// Ends the load with `end` performed on its flight.
    fn end(this: wcache::Load, end: impl FnOnce(&mut Driver) -> Step) -> Result<Vec<u8>, types::Error> {
        let loading: Loading = this.into_inner();
        let Some(mut driver) = loading.driver.borrow_mut().take() else {
            return Err(types::Error::Other("the load had ended already".to_string()));
        };
        let result = match end(&mut driver) {
            Step::Done(result) => result,
            Step::Load => {
                driver.abandon();
                Err(types::Error::Other(
                    "the flight asked for a second load".to_string(),
                ))
            }
        };
        if let Some(shared) = &loading.shared {
            *shared.outcome.borrow_mut() = Some(result.clone());
            forget(driver.key(), shared);
        }
        result
    }
}

/// The load of `key` is no longer open in this instance (if `shared` is still its).
fn forget(key: &str, shared: &Rc<Shared>) {
    OPEN.with(|open| {
        let mut open = open.borrow_mut();
        if open.get(key).is_some_and(|s| Rc::ptr_eq(s, shared)) {
            open.remove(key);
        }
    });
}

impl Drop for Loading {
    fn drop(&mut self) {
        let Some(mut driver) = self.driver.get_mut().take() else {
            return;
        };
        driver.abandon();
        if let Some(shared) = &self.shared {
            *shared.dropped.borrow_mut() = true;
            forget(driver.key(), shared);
        }
    }
}

impl wcache::GuestLoad for Loading {
    fn key(&self) -> String {
        self.driver
            .borrow()
            .as_ref()
            .map_or_else(String::new, |d| d.key().to_owned())
    }

    fn complete(this: wcache::Load, value: Vec<u8>, cacheable: bool) -> Result<Vec<u8>, types::Error> {
        Loading::end(this, |driver| driver.loaded(value, cacheable))
    }

    fn fail(this: wcache::Load, reason: String) -> Result<Vec<u8>, types::Error> {
        Loading::end(this, |driver| driver.failed(reason))
    }
}

/// A caller waiting for the load another caller of this instance holds.
pub(crate) struct Following {
    shared: RefCell<Rc<Shared>>,
    /// The key's L1 ticket when this caller began (or led in a load's place).
    since: RefCell<l1::L1Ticket>,
    request: Request,
    /// What this caller got once it led in its own right: asked again, the same.
    settled: RefCell<Option<Result<Vec<u8>, types::Error>>>,
}

/// Whether the key is as it was at `then` (its writes, heard changes and clears; a
/// flush of all of L1 after a gap in the announcements does not count, every key would).
fn key_unchanged(then: &l1::L1Ticket, now: &l1::L1Ticket) -> bool {
    then.writes == now.writes && then.generations == now.generations
}

impl wcache::GuestFollower for Following {
    fn outcome(&self) -> Followed {
        if let Some(settled) = self.settled.borrow().clone() {
            return Followed::Ready(settled);
        }
        let shared = self.shared.borrow().clone();
        let ended = shared.outcome.borrow().clone();
        match ended {
            Some(outcome) if key_unchanged(&shared.ticket, &self.since.borrow()) => {
                return Followed::Ready(outcome);
            }
            // The key changed after that load began: its value may be older than the
            // change, and this caller came after it.
            Some(_) => {}
            None if !*shared.dropped.borrow() => return Followed::Pending,
            None => {}
        }
        // Another follower may have taken its place already; else this one does.
        if let Some(newer) = open(&self.request.key)
            && !Rc::ptr_eq(&newer, &shared)
        {
            *self.shared.borrow_mut() = newer;
            return Followed::Pending;
        }
        let settle = |outcome: Result<Vec<u8>, types::Error>| {
            *self.settled.borrow_mut() = Some(outcome.clone());
            Followed::Ready(outcome)
        };
        match lead(self.request.clone()) {
            Ok(Begun::Lead(load)) => {
                // From now on this caller follows the load it holds.
                if let Some(own) = open(&self.request.key) {
                    *self.since.borrow_mut() = own.ticket;
                    *self.shared.borrow_mut() = own;
                }
                Followed::Lead(load)
            }
            Ok(Begun::Hit(value) | Begun::Refresh((value, _))) => settle(Ok(value)),
            Ok(Begun::Wait(_)) => Followed::Pending,
            Err(e) => settle(Err(e)),
        }
    }
}

/// The first phase of a get-or-set (`cache.begin`).
pub(crate) fn begin(
    key: String,
    options: types::EntryOptions,
    bypass: bool,
    tags: Vec<String>,
) -> Result<Begun, types::Error> {
    let settings = settings();
    let now = now_ms();
    // Judged first, the same whether the key is in L1, led in this instance, or cold.
    Flight::start(
        &key,
        options_in(options),
        settings.flight(bypass),
        now,
        &settings.limits,
    )
    .map_err(arg_error)?;
    check_tags(&tags)?;
    // The reads before the flight (an L1 hit's tags, the generation) get one store
    // timeout, as the native body's; the flight then arms its own deadlines.
    l2::bound(settings.store_timeout_ms);
    let request = Request {
        key,
        options,
        bypass,
        tags,
    };
    if !bypass && let Some(entry) = l1_entry(&request.key, now, true) {
        if entry.refresh_at_ms.is_some_and(|at| now >= at) {
            // Disarmed first: this copy starts no other refresh. Not a write: only over
            // the very copy read, and refused if the key is written meanwhile.
            let ticket = l1::ticket(&request.key);
            if l1::get(&request.key).is_some_and(|again| same_copy(&again, &entry)) {
                let disarmed = l1::L1Entry {
                    refresh_at_ms: None,
                    ..entry.clone()
                };
                l1::fill(&request.key, &disarmed, ticket);
            }
            return Ok(with_refresh(entry.value, &request, &settings));
        }
        return Ok(Begun::Hit(entry.value));
    }
    if bypass {
        return fly(request, &settings, Role::Bypass);
    }
    if let Some(shared) = open(&request.key) {
        return Ok(Begun::Wait(wcache::Follower::new(Following {
            shared: RefCell::new(shared),
            since: RefCell::new(l1::ticket(&request.key)),
            request,
            settled: RefCell::new(None),
        })));
    }
    lead(request)
}

/// Joins the process's flight of the request's key: its outcome, or this caller leads.
fn lead(request: Request) -> Result<Begun, types::Error> {
    match flights::join(&request.key) {
        Joined::Value(v) => Ok(Begun::Hit(v)),
        Joined::Failed(e) => Err(e),
        Joined::Lead => fly(request, &settings(), Role::Leader),
    }
}

/// What a flight is to the process.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// It leads the process's flight of its key.
    Leader,
    /// A bypass: no locks, no followers.
    Bypass,
    /// A background refresh (contract §6b.3): no followers.
    Refresh,
}

/// Runs a flight of the request to its load or its end.
fn fly(request: Request, settings: &Settings, role: Role) -> Result<Begun, types::Error> {
    let config = FlightConfig {
        refresh: role == Role::Refresh,
        ..settings.flight(request.bypass)
    };
    let ticket = l1::ticket(&request.key);
    let (mut driver, action) = match start(&request, settings, config) {
        Ok(started) => started,
        Err(e) => {
            // A flight that could not start hands its error on.
            if role == Role::Leader {
                flights::finish(&request.key, Err(&e));
            }
            return Err(e);
        }
    };
    if role == Role::Leader {
        driver.lead();
    }
    match driver.start(action) {
        Step::Load => {
            let shared = (role == Role::Leader).then(|| {
                let shared = Rc::new(Shared {
                    ticket,
                    outcome: RefCell::new(None),
                    dropped: RefCell::new(false),
                });
                OPEN.with(|open| open.borrow_mut().insert(request.key.clone(), shared.clone()));
                shared
            });
            Ok(Begun::Lead(wcache::Load::new(Loading {
                driver: RefCell::new(Some(driver)),
                shared,
            })))
        }
        Step::Done(result) => {
            let value = result?;
            if role != Role::Refresh && driver.refresh_due() {
                return Ok(with_refresh(value, &request, settings));
            }
            Ok(Begun::Hit(value))
        }
    }
}

/// The driver of a new flight of the request, and its first action.
fn start(
    request: &Request,
    settings: &Settings,
    config: FlightConfig,
) -> Result<(Driver, corral_core::flight::Action), types::Error> {
    let (flight, action) = Flight::start(
        &request.key,
        options_in(request.options),
        config,
        now_ms(),
        &settings.limits,
    )
    .map_err(arg_error)?;
    check_tags(&request.tags)?;
    let named = l1::ticket(&request.key);
    let (names, named_known) = if config.refresh {
        (locate(&request.key, &settings.limits)?, true)
    } else {
        locate_for_flight(&request.key, &settings.limits)?
    };
    let mut driver = Driver::new(
        flight,
        request.key.clone(),
        names,
        named,
        settings.limits,
        request.tags.clone(),
    );
    if !named_known {
        driver.unnamed();
    }
    Ok((driver, action))
}

/// `value`, due for its eager refresh: with the refresh's load when the refresh flight
/// got as far as loading (it takes the lock without waiting: one held elsewhere, or a
/// failing store, ends it with nothing to do).
fn with_refresh(value: Vec<u8>, request: &Request, settings: &Settings) -> Begun {
    match fly(request.clone(), settings, Role::Refresh) {
        Ok(Begun::Lead(load)) => Begun::Refresh((value, load)),
        _ => Begun::Hit(value),
    }
}
