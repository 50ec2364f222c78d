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
//!
//! An eager refresh's load is kept too: a caller of the instance whose flight would wait
//! for the key's lock, which that refresh holds, follows the refresh instead (the
//! instance could not end the refresh while it waits), and once the refresh ended, reads
//! again what it left.
//!
//! The caller's load cannot be stopped, but its timeouts are kept for its followers: a
//! follower that asks once the load's soft timeout is due gets the stale copy the
//! machine answers with, and one that asks past its hard timeout ends the flight with
//! what a hard timeout gives every caller (contract §7.2), the holder's late end
//! included.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use corral_core::Settings;
use corral_core::flight::{Action, Flight, FlightConfig};

use super::driver::{Driver, Step};
use super::{
    check_tags, flight_generation, generation, l1_entry, locate_for_flight, locate_in_flight_generation,
    now_ms, same_copy, settings,
};
use crate::bindings::corral::cache::flights::{self, Joined};
use crate::bindings::corral::cache::{l1, l2, types};
use crate::bindings::exports::corral::cache::cache::{self as wcache, Begun, Followed};
use crate::{arg_error, options_in};

/// A load a caller holds, and what its followers in this instance learn of it.
struct Shared {
    /// The flight, stopped at its load. Taken when the load ends: by its holder, or by a
    /// follower that found its hard timeout past ([`Shared::overdue`]); still here when
    /// it is dropped without an end.
    driver: RefCell<Option<Driver>>,
    /// The key's L1 ticket when the load's flight began.
    ticket: l1::L1Ticket,
    /// How it ended.
    outcome: RefCell<Option<Result<Vec<u8>, types::Error>>>,
    /// It was dropped without an end.
    dropped: RefCell<bool>,
    /// It leads the process's flight of its key: this instance's callers of the key
    /// follow it.
    leads: bool,
    /// An eager refresh's: when its flight lock lapses (its holder may never end it, and
    /// it renews nothing; past then, nobody follows it). Its followers begin again once
    /// it is over, rather than take its outcome (a refresh's failure is no caller's), and
    /// its timeouts answer nobody.
    refresh: Option<u64>,
    /// The callers answered at the soft timeout: the followers that began up to this
    /// count ([`FOLLOWERS`]) were waiting then. One that begins later waits for the
    /// load's end, or finds the stale copy in L1 for as long as the machine let L1 keep
    /// it, as a native caller coming after the answer does.
    answered_upto: Cell<Option<u64>>,
}

impl Shared {
    /// An eager refresh that ended, was dropped, or whose lock lapsed: its followers
    /// begin again.
    fn over(&self) -> bool {
        self.outcome.borrow().is_some()
            || *self.dropped.borrow()
            || self.refresh.is_some_and(|lapses_at| now_ms() >= lapses_at)
    }

    /// The load ended with `result`: its followers get it.
    fn ended(self: &Rc<Self>, key: &str, result: &Result<Vec<u8>, types::Error>) {
        *self.outcome.borrow_mut() = Some(result.clone());
        self.forget(key);
    }

    /// Its load is no longer open in this instance.
    fn forget(self: &Rc<Self>, key: &str) {
        if self.leads {
            forget(&OPEN, key, self);
        } else if self.refresh.is_some() {
            forget(&REFRESHING, key, self);
        }
    }

    /// Reports a timeout of the load that fell due (the follower asking is the timer a
    /// native body would have); a hard timeout ends the flight here.
    fn overdue(self: &Rc<Self>) {
        if self.refresh.is_some() {
            return;
        }
        let mut cell = self.driver.borrow_mut();
        let Some(driver) = cell.as_mut() else {
            return;
        };
        let Some(step) = driver.overdue() else {
            return;
        };
        let result = match step {
            Step::Load => {
                if driver.answered().is_some() && self.answered_upto.get().is_none() {
                    self.answered_upto.set(Some(FOLLOWERS.with(Cell::get)));
                }
                return;
            }
            Step::Done(result) => result,
            Step::Parked => Err(second_load()),
        };
        let Some(driver) = cell.take() else {
            return;
        };
        drop(cell);
        self.ended(driver.key(), &result);
    }

    /// The stale copy the load's callers were answered with at its soft timeout, if
    /// the follower counted `follower` was one of them.
    fn answered(&self, follower: u64) -> Option<Vec<u8>> {
        self.answered_upto.get().filter(|&upto| follower <= upto)?;
        self.driver.borrow().as_ref()?.answered().map(<[u8]>::to_vec)
    }
}

/// What a flight that asked for a second load ends with (never: a load ends it).
fn second_load() -> types::Error {
    types::Error::Other("the flight asked for a second load".to_string())
}

thread_local! {
    /// The loads this instance's callers hold as their process's leader of a key.
    static OPEN: RefCell<HashMap<String, Rc<Shared>>> = RefCell::new(HashMap::new());
    /// The eager refreshes this instance's callers hold, by key.
    static REFRESHING: RefCell<HashMap<String, Rc<Shared>>> = RefCell::new(HashMap::new());
    /// How many followers this instance's callers began: each follower's number.
    static FOLLOWERS: Cell<u64> = const { Cell::new(0) };
}

/// The load of `key` a caller of this instance holds, if any.
fn open(key: &str) -> Option<Rc<Shared>> {
    OPEN.with(|open| open.borrow().get(key).cloned())
}

/// The eager refresh of `key` a caller of this instance holds, if any, while its lock
/// lives.
fn refreshing(key: &str) -> Option<Rc<Shared>> {
    REFRESHING
        .with(|open| open.borrow().get(key).cloned())
        .filter(|refresh| !refresh.over())
}

/// What a get-or-set was asked with: what a follower needs to lead in a dropped load's
/// place, and a hit to start its eager refresh.
#[derive(Clone)]
struct Request {
    key: String,
    options: types::EntryOptions,
    bypass: bool,
    tags: Vec<String>,
    /// When its call judged the options: every flight of the call starts from that
    /// verdict (one that leads after following, a batch's key, a refresh).
    judged_ms: u64,
    /// Its caller can be handed the eager refresh its flight finds due: a caller that
    /// followed cannot (`outcome` answers with a value alone), and leaves it due.
    takes_refresh: bool,
}

impl Request {
    /// The request of a caller that followed and now begins in its own right.
    fn followed(&self) -> Request {
        Request {
            takes_refresh: false,
            ..self.clone()
        }
    }
}

/// A load the caller holds: the flight stopped at its load, and what its followers in
/// this instance learn of it.
pub(crate) struct Loading {
    shared: Rc<Shared>,
}

impl Loading {
    /// Ends the load with `end` performed on its flight.
    fn end(this: wcache::Load, end: impl FnOnce(&mut Driver) -> Step) -> Result<Vec<u8>, types::Error> {
        let loading: Loading = this.into_inner();
        let shared = &loading.shared;
        let taken = shared.driver.borrow_mut().take();
        let Some(mut driver) = taken else {
            // Its hard timeout ended the flight: what its followers got is the holder's.
            return shared
                .outcome
                .borrow()
                .clone()
                .unwrap_or_else(|| Err(types::Error::Other("the load had ended already".to_string())));
        };
        let result = match end(&mut driver) {
            Step::Done(result) => result,
            // After its load, a flight never waits for a landing (nor parks: a load
            // ends it).
            Step::Load | Step::Parked => {
                driver.abandon();
                Err(second_load())
            }
        };
        shared.ended(driver.key(), &result);
        result
    }
}

/// The load of `key` is no longer open in this instance (if `shared` is still its in
/// `loads`).
fn forget(
    loads: &'static std::thread::LocalKey<RefCell<HashMap<String, Rc<Shared>>>>,
    key: &str,
    shared: &Rc<Shared>,
) {
    loads.with(|open| {
        let mut open = open.borrow_mut();
        if open.get(key).is_some_and(|s| Rc::ptr_eq(s, shared)) {
            open.remove(key);
        }
    });
}

impl Drop for Loading {
    fn drop(&mut self) {
        let Some(mut driver) = self.shared.driver.borrow_mut().take() else {
            return;
        };
        driver.abandon();
        *self.shared.dropped.borrow_mut() = true;
        self.shared.forget(driver.key());
    }
}

impl wcache::GuestLoad for Loading {
    fn key(&self) -> String {
        self.shared
            .driver
            .borrow()
            .as_ref()
            .map_or_else(String::new, |d| d.key().to_owned())
    }

    fn begin(&self) {
        if let Some(driver) = self.shared.driver.borrow_mut().as_mut() {
            driver.began();
        }
    }

    fn complete(this: wcache::Load, value: Vec<u8>, cacheable: bool) -> Result<Vec<u8>, types::Error> {
        Loading::end(this, |driver| driver.loaded(value, cacheable))
    }

    fn fail(this: wcache::Load, reason: String) -> Result<Vec<u8>, types::Error> {
        Loading::end(this, |driver| driver.failed(reason))
    }
}

/// A caller waiting for the load another caller of this instance holds (or for the
/// end of the instance's eager refresh of the key, whose lock its flight met), or
/// (`None`) for the flight another caller of the process leads, joined by a batch
/// (`flights.join-many`): asked, it joins that flight for its outcome.
pub(crate) struct Following {
    shared: RefCell<Option<Rc<Shared>>>,
    /// The key's L1 ticket when this caller began (or led in a load's place).
    since: RefCell<l1::L1Ticket>,
    request: Request,
    /// What this caller got once it led in its own right, or was answered with at a
    /// load's soft timeout: asked again, the same.
    settled: RefCell<Option<Result<Vec<u8>, types::Error>>>,
    /// Its number among the instance's followers ([`FOLLOWERS`]).
    number: u64,
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
        if let Some(shared) = shared.as_ref().filter(|s| s.refresh.is_some()) {
            if !shared.over() {
                return Followed::Pending;
            }
            return self.again();
        } else if let Some(shared) = shared {
            shared.overdue();
            let unchanged = key_unchanged(&shared.ticket, &self.since.borrow());
            if unchanged && let Some(stale) = shared.answered(self.number) {
                *self.settled.borrow_mut() = Some(Ok(stale.clone()));
                return Followed::Ready(Ok(stale));
            }
            let ended = shared.outcome.borrow().clone();
            match ended {
                Some(outcome) if unchanged => {
                    return Followed::Ready(outcome);
                }
                // The key changed after that load began: its value may be older than
                // the change, and this caller came after it.
                Some(_) => {}
                None if !*shared.dropped.borrow() => return Followed::Pending,
                None => {}
            }
            // Another follower may have taken its place already; else this one does.
            if let Some(newer) = open(&self.request.key)
                && !Rc::ptr_eq(&newer, &shared)
            {
                *self.shared.borrow_mut() = Some(newer);
                return Followed::Pending;
            }
        }
        self.led(lead(self.request.followed()))
    }
}

impl Following {
    /// Begins again once the refresh it followed is over, as a new caller would.
    fn again(&self) -> Followed {
        self.led(begin_request(self.request.followed(), now_ms(), &settings()))
    }

    /// What this caller got once it led in its own right (`begun`).
    fn led(&self, begun: Result<Begun, types::Error>) -> Followed {
        let settle = |outcome: Result<Vec<u8>, types::Error>| {
            *self.settled.borrow_mut() = Some(outcome.clone());
            Followed::Ready(outcome)
        };
        match begun {
            Ok(Begun::Lead(load)) => {
                // From now on this caller follows the load it holds.
                if let Some(own) = open(&self.request.key) {
                    *self.since.borrow_mut() = own.ticket;
                    *self.shared.borrow_mut() = Some(own);
                }
                Followed::Lead(load)
            }
            // A follower's request takes no refresh ([`Request::followed`]): its flight
            // leaves a due refresh to the next caller rather than begin one to drop.
            Ok(Begun::Hit(value) | Begun::Refresh((value, _))) => settle(Ok(value)),
            // It follows another load now (one of the instance, a newer refresh's, or the
            // process's flight).
            Ok(Begun::Wait(follower)) => {
                let newer: Following = follower.into_inner();
                *self.since.borrow_mut() = newer.since.into_inner();
                *self.shared.borrow_mut() = newer.shared.into_inner();
                Followed::Pending
            }
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
        judged_ms: now,
        takes_refresh: true,
    };
    if bypass {
        return fly(request, &settings, Role::Bypass);
    }
    begin_request(request, now, &settings)
}

/// A (not bypassing) caller of the request begins at `now`: served from L1, following a
/// load of the instance, or through the process's flight.
fn begin_request(request: Request, now: u64, settings: &Settings) -> Result<Begun, types::Error> {
    if let Some(hit) = from_l1(&request, now, settings) {
        return Ok(hit);
    }
    if let Some(shared) = open(&request.key) {
        return Ok(follow(Some(shared), request));
    }
    lead(request)
}

/// The request's value from L1, if L1 holds a servable copy (with its eager refresh,
/// when one is due).
fn from_l1(request: &Request, now: u64, settings: &Settings) -> Option<Begun> {
    let (value, due) = l1_hit(request, now)?;
    Some(if due {
        with_refresh(value, request, settings)
    } else {
        Begun::Hit(value)
    })
}

/// The value of the request's key from L1, if L1 holds a servable copy, and whether
/// its eager refresh fell due for a caller that takes it (then this copy is disarmed: it
/// starts no other; for one that does not, it stays armed for the next caller).
fn l1_hit(request: &Request, now: u64) -> Option<(Vec<u8>, bool)> {
    let entry = l1_entry(&request.key, now, true)?;
    // A caller that cannot take the refresh leaves the copy due for the next.
    if request.takes_refresh && entry.refresh_at_ms.is_some_and(|at| now >= at) {
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
        return Some((entry.value, true));
    }
    Some((entry.value, false))
}

/// A caller that follows `shared` (a load of this instance), or the flight of the
/// process it joined (`None`).
fn follow(shared: Option<Rc<Shared>>, request: Request) -> Begun {
    // A soft timeout that fell due answered the followers before this one only.
    if let Some(shared) = &shared {
        shared.overdue();
    }
    Begun::Wait(wcache::Follower::new(Following {
        shared: RefCell::new(shared),
        since: RefCell::new(l1::ticket(&request.key)),
        request,
        settled: RefCell::new(None),
        number: FOLLOWERS.with(|n| {
            n.set(n.get() + 1);
            n.get()
        }),
    }))
}

/// The first phase of a get-or-set of many keys (`cache.begin-many`, contract §5.16):
/// each key's `begun`, in order. The keys not served at once join the process's
/// flights together; the flights this caller leads make their first reads together
/// (one `l2.get-many`), and none of them waits for another process's landing while
/// the batch holds its other keys' flight locks.
pub(crate) fn begin_many(
    keys: Vec<String>,
    options: types::EntryOptions,
    bypass: bool,
    tags: Vec<String>,
) -> Result<Vec<Result<Begun, types::Error>>, types::Error> {
    let settings = settings();
    let now = now_ms();
    // Judged first, the same whatever is cached, in the native body's order: the first
    // key, the options, every key, the tags. No key: nothing to judge.
    let Some(first) = keys.first() else {
        return Ok(Vec::new());
    };
    corral_core::key::validate(first, &settings.limits)
        .map_err(|e| arg_error(corral_core::batch::at_position(0, e)))?;
    let config = settings.flight(bypass);
    Flight::check(&options_in(options), &config, now, &settings.limits).map_err(arg_error)?;
    corral_core::batch::check_distinct(&keys, &settings.limits).map_err(arg_error)?;
    check_tags(&tags)?;
    l2::bound(settings.store_timeout_ms);
    let request = |key: &str| Request {
        key: key.to_owned(),
        options,
        bypass,
        tags: tags.clone(),
        judged_ms: now,
        takes_refresh: true,
    };
    if bypass {
        // No read first, but the keys are named as a batch's are: in one generation,
        // found once for them all.
        let requests = keys.iter().map(|key| request(key)).collect();
        return Ok(begin_flights(requests, &settings, Role::Bypass)
            .into_iter()
            .map(|begun| {
                let (request, ticket, driver, action) = begun?;
                drive(driver, action, request, ticket, &settings, Role::Bypass)
            })
            .collect());
    }
    let mut begun: Vec<Option<Result<Begun, types::Error>>> = keys.iter().map(|_| None).collect();
    // The keys L1 does not serve, and those it serves with their refresh due (each with
    // its position, request and copy).
    let mut cold: Vec<usize> = Vec::new();
    let mut due: Vec<(usize, Request, Vec<u8>)> = Vec::new();
    for (at, key) in keys.iter().enumerate() {
        let request = request(key);
        begun[at] = if let Some((value, refresh)) = l1_hit(&request, now) {
            if refresh {
                due.push((at, request, value));
                None
            } else {
                Some(Ok(Begun::Hit(value)))
            }
        } else if let Some(shared) = open(key) {
            Some(Ok(follow(Some(shared), request)))
        } else {
            cold.push(at);
            None
        };
    }
    let joined = flights::join_many(&cold.iter().map(|&at| keys[at].clone()).collect::<Vec<_>>());
    let (mut led, mut led_at) = (Vec::new(), Vec::new());
    for (&at, leads) in cold.iter().zip(joined) {
        if leads {
            led.push(request(&keys[at]));
            led_at.push(at);
        } else {
            begun[at] = Some(Ok(follow(None, request(&keys[at]))));
        }
    }
    for (at, driven) in led_at.into_iter().zip(lead_many(led, &settings)) {
        begun[at] = match driven {
            Ok(Driven::Begun(b)) => Some(Ok(b)),
            // An L2 hit due for its refresh: refreshed with the L1 hits due.
            Ok(Driven::Due(request, value)) => {
                due.push((at, request, value));
                None
            }
            Err(e) => Some(Err(e)),
        };
    }
    refresh_into(&mut begun, due, &settings);
    Ok(begun
        .into_iter()
        .map(|b| b.unwrap_or_else(|| Err(lost())))
        .collect())
}

/// An answer a batch lost track of (never: every led key gets one).
fn lost() -> types::Error {
    types::Error::Other("the batch lost a key's flight".to_string())
}

/// The flights of `led` (keys this caller leads in the process), in order: their first
/// reads made together (one store timeout), then each run, under its own deadline, to
/// its load, its end, or a wait for another process's landing: that key follows the
/// process's flight of it once the batch's loads ended ([`Step::Parked`]).
fn lead_many(led: Vec<Request>, settings: &Settings) -> Vec<Result<Driven, types::Error>> {
    let mut started = begin_flights(led, settings, Role::Leader);
    let reading: Vec<_> = started
        .iter_mut()
        .filter_map(|s| s.as_mut().ok())
        .filter(|(_, _, driver, action)| driver.named() && matches!(action, Action::ReadL2))
        .collect();
    let tickets: Vec<_> = reading
        .iter()
        .map(|(_, _, driver, _)| driver.read_ticket())
        .collect();
    let names: Vec<String> = reading
        .iter()
        .map(|(_, _, driver, _)| driver.entry_name().to_owned())
        .collect();
    // The reads together get one store timeout, as a single key's first read.
    l2::bound(settings.store_timeout_ms);
    let reads = if names.is_empty() {
        Vec::new()
    } else {
        l2::get_many(&names)
    };
    for (((_, _, driver, _), read), ticket) in reading.into_iter().zip(reads).zip(tickets) {
        driver.first_read(read, ticket);
    }
    started
        .into_iter()
        .map(|s| {
            let (request, ticket, mut driver, action) = s?;
            driver.park_at_wait();
            drive_to(driver, action, request, ticket, settings, Role::Leader)
        })
        .collect()
}

/// Begins the refreshes a batch's hits fell due for (`due`: each key's position, its
/// request and the value it is served), each key's answer put in `begun`.
fn refresh_into(
    begun: &mut [Option<Result<Begun, types::Error>>],
    due: Vec<(usize, Request, Vec<u8>)>,
    settings: &Settings,
) {
    let (at, due): (Vec<usize>, Vec<(Request, Vec<u8>)>) = due
        .into_iter()
        .map(|(at, request, value)| (at, (request, value)))
        .unzip();
    for (at, refreshing) in at.into_iter().zip(refresh_many(due, settings)) {
        begun[at] = Some(Ok(refreshing));
    }
}

/// The eager refreshes a batch's hits fell due for (`due`: each request and the value its
/// caller is served: L1 hits, and led keys' L2 hits), begun together once its other keys
/// are: the steps before their loads share one bound, and the prefix's generation is
/// found once for them all ([`refresh_namings`]).
fn refresh_many(due: Vec<(Request, Vec<u8>)>, settings: &Settings) -> Vec<Begun> {
    if due.is_empty() {
        return Vec::new();
    }
    let (namings, bound_until) = refresh_namings(due.iter().map(|(request, _)| request), settings);
    due.into_iter()
        .zip(namings)
        .map(|((request, value), naming)| refresh_one(request, value, naming, bound_until, settings))
        .collect()
}

/// How the refreshes of `requests` name their keys, and when the bound their steps
/// before their loads share ends. Arms that bound (a refresh's budget: one store
/// timeout, the generation's read included), takes each key's ticket, then finds the
/// generation once. A refresh names its key only in a generation read from the store, no
/// stand-in (contract §7.3): where it cannot be read, no refresh begins (`None`).
fn refresh_namings<'r>(
    requests: impl Iterator<Item = &'r Request>,
    settings: &Settings,
) -> (Vec<Option<BatchNaming>>, u64) {
    let bound_ms = settings.store_budget().refresh_before_load_ms;
    l2::bound(bound_ms);
    let bound_until = now_ms().saturating_add(bound_ms);
    let named: Vec<l1::L1Ticket> = requests.map(|request| l1::ticket(&request.key)).collect();
    let generation = generation(now_ms()).ok();
    let namings = named
        .into_iter()
        .map(|named| {
            generation.map(|generation| BatchNaming {
                generation: (generation, true),
                named,
            })
        })
        .collect();
    (namings, bound_until)
}

/// `value`, due for its eager refresh, served with the refresh begun (`naming`: how it
/// names its key, [`refresh_namings`]; none, no refresh) within the bound armed for it,
/// which ends at `bound_until`.
fn refresh_one(
    request: Request,
    value: Vec<u8>,
    naming: Option<BatchNaming>,
    bound_until: u64,
    settings: &Settings,
) -> Begun {
    let Some(naming) = naming else {
        return Begun::Hit(value);
    };
    let flown = begin_flight(&request, settings, Role::Refresh, Some(naming)).and_then(
        |(mut driver, action, ticket)| {
            driver.within_batch_bound(bound_until);
            drive(driver, action, request, ticket, settings, Role::Refresh)
        },
    );
    served_refreshing(value, flown)
}

/// A flight begun: its request, the key's ticket when it began, its driver and its first
/// action.
type Started = (Request, l1::L1Ticket, Driver, Action);

/// The flights of a batch's `requests` begun in `role`, in order. Each key's ticket is
/// taken before its names (L1 is never filled across a clear after them), then the names
/// are found in one generation, read (or found unreadable) once for them all: a batch
/// whose read of it fails does not read it again for each key (contract §5.16).
fn begin_flights(
    requests: Vec<Request>,
    settings: &Settings,
    role: Role,
) -> Vec<Result<Started, types::Error>> {
    let named: Vec<l1::L1Ticket> = requests.iter().map(|request| l1::ticket(&request.key)).collect();
    let generation = (!requests.is_empty()).then(flight_generation);
    requests
        .into_iter()
        .zip(named)
        .map(|(request, named)| {
            let batch = generation.map(|generation| BatchNaming { generation, named });
            let (driver, action, ticket) = begin_flight(&request, settings, role, batch)?;
            Ok((request, ticket, driver, action))
        })
        .collect()
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
    /// A background refresh (contract §7.3): no followers.
    Refresh,
}

/// Runs a flight of the request to its load or its end.
fn fly(request: Request, settings: &Settings, role: Role) -> Result<Begun, types::Error> {
    let (driver, action, ticket) = begin_flight(&request, settings, role, None)?;
    drive(driver, action, request, ticket, settings, role)
}

/// A new flight of the request in its role: its driver, its first action, and the key's
/// ticket when it began. A leader's flight that could not start hands its error on to
/// the process's followers of the key. `batch`: a batch's key, named as its batch found;
/// else the flight names its key itself.
fn begin_flight(
    request: &Request,
    settings: &Settings,
    role: Role,
    batch: Option<BatchNaming>,
) -> Result<(Driver, Action, l1::L1Ticket), types::Error> {
    let config = FlightConfig {
        refresh: role == Role::Refresh,
        starts_refresh: request.takes_refresh,
        ..settings.flight(request.bypass)
    };
    // A batch's key began when its batch took its ticket, before finding its names.
    let ticket = batch.map_or_else(|| l1::ticket(&request.key), |b| b.named);
    let (mut driver, action) = start(request, settings, config, batch).inspect_err(|e| {
        if role == Role::Leader {
            flights::finish(&request.key, Err(e));
        }
    })?;
    if role == Role::Leader {
        driver.lead();
        // Waiting for the lock this instance's refresh holds would keep the refresh
        // from ending: the flight follows the refresh instead.
        if refreshing(&request.key).is_some() {
            driver.park_at_wait();
        }
    }
    Ok((driver, action, ticket))
}

/// Where a flight driven to its load or its end ([`drive_to`]) leaves its caller.
enum Driven {
    Begun(Begun),
    /// Served `value`, due for its eager refresh, which the caller begins.
    Due(Request, Vec<u8>),
}

/// Runs a started flight from `action` to its load or its end (see [`drive_to`]); a
/// value due for its refresh is served with the refresh begun.
fn drive(
    driver: Driver,
    action: Action,
    request: Request,
    ticket: l1::L1Ticket,
    settings: &Settings,
    role: Role,
) -> Result<Begun, types::Error> {
    Ok(match drive_to(driver, action, request, ticket, settings, role)? {
        Driven::Begun(begun) => begun,
        Driven::Due(request, value) => with_refresh(value, &request, settings),
    })
}

/// Runs a started flight from `action` to its load or its end, its store steps under
/// one deadline until then (contract §5.13); `ticket`, the key's when it began.
fn drive_to(
    mut driver: Driver,
    action: Action,
    request: Request,
    ticket: l1::L1Ticket,
    settings: &Settings,
    role: Role,
) -> Result<Driven, types::Error> {
    match driver.start(action) {
        Step::Load => {
            let leads = role == Role::Leader;
            let shared = Rc::new(Shared {
                driver: RefCell::new(Some(driver)),
                ticket,
                outcome: RefCell::new(None),
                dropped: RefCell::new(false),
                answered_upto: Cell::new(None),
                leads,
                refresh: (role == Role::Refresh).then(|| now_ms().saturating_add(settings.lock_ttl_ms)),
            });
            if leads {
                OPEN.with(|open| open.borrow_mut().insert(request.key.clone(), shared.clone()));
            } else if role == Role::Refresh {
                REFRESHING.with(|open| open.borrow_mut().insert(request.key.clone(), shared.clone()));
            }
            Ok(Driven::Begun(Begun::Lead(wcache::Load::new(Loading { shared }))))
        }
        Step::Done(result) => {
            let value = result?;
            if role != Role::Refresh && driver.refresh_due() {
                return Ok(Driven::Due(request, value));
            }
            Ok(Driven::Begun(Begun::Hit(value)))
        }
        // A batch's flight that would wait for another process's landing holds no lock
        // yet: it gives up the process's flight of its key (a caller there leads in its
        // place, and waits within its own deadline) and follows it once the batch's
        // loads ended. Holding on while its caller loads other keys could make two
        // batches wait on each other.
        Step::Parked => {
            driver.abandon();
            Ok(Driven::Begun(follow(refreshing(&request.key), request)))
        }
    }
}

/// How a batch named a key it leads: the generation it found for its keys
/// (`flight_generation`), and the key's ticket, taken before that.
#[derive(Clone, Copy)]
struct BatchNaming {
    generation: (u64, bool),
    named: l1::L1Ticket,
}

/// The driver of a new flight of the request, and its first action.
fn start(
    request: &Request,
    settings: &Settings,
    config: FlightConfig,
    batch: Option<BatchNaming>,
) -> Result<(Driver, Action), types::Error> {
    let now = now_ms();
    let (flight, action) = Flight::start_judged(
        &request.key,
        options_in(request.options),
        config,
        request.judged_ms,
        now,
        &settings.limits,
    )
    .map_err(arg_error)?;
    check_tags(&request.tags)?;
    // Taken before the names: L1 is never filled across a clear after them.
    let named = batch.map_or_else(|| l1::ticket(&request.key), |b| b.named);
    let (names, named_known) = match batch {
        // A batch's key (checked with its batch), in its batch's generation; a refresh
        // is always named so ([`refresh_namings`]).
        Some(b) => locate_in_flight_generation(&request.key, b.generation, &settings.limits)?,
        None => locate_for_flight(&request.key, &settings.limits)?,
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
    let (mut namings, bound_until) = refresh_namings(std::iter::once(request), settings);
    let naming = namings.pop().flatten();
    refresh_one(request.clone(), value, naming, bound_until, settings)
}

/// `value` served, with the load of its refresh when the refresh's flight (`flown`)
/// got as far as loading; else (it ended, or could not begin) the value alone.
fn served_refreshing(value: Vec<u8>, flown: Result<Begun, types::Error>) -> Begun {
    match flown {
        Ok(Begun::Lead(load)) => Begun::Refresh((value, load)),
        _ => Begun::Hit(value),
    }
}
