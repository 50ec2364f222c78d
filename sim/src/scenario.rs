//! What a run simulates: how many processes, what they do, which faults, how often.

/// Fault rates, per mille unless said otherwise.
#[derive(Clone, Copy, Debug, Default)]
pub struct FaultRates {
    /// A one-way trip is slow (50..400 ms).
    pub delay_pm: u32,
    /// The store applies a command, the reply is lost (error after the 1 s timeout).
    pub reply_lost_pm: u32,
    /// A notification is not delivered to one process.
    pub notify_lost_pm: u32,
    /// Per process and run: its connection goes down for 100..2000 ms.
    pub down_pm: u32,
    /// Per run: the store restarts empty once.
    pub restart_pm: u32,
    /// Per process and run: its wall clock is skewed (±300 ms), and, again, stepped
    /// (±500..3000 ms at some moment).
    pub clock_pm: u32,
    /// Per load: slow (300..2500 ms, past the lock TTL at the top), failing, panicking.
    pub loader_slow_pm: u32,
    pub loader_fail_pm: u32,
    pub loader_panic_pm: u32,
    /// Per process and run: it is paused (none of its tasks runs) for 300..4000 ms,
    /// past the flight lock's TTL and a lease's at the top, then resumes.
    pub pause_pm: u32,
    /// Per run: one process crashes (its tasks are dropped mid-flight, its locks left to
    /// expire; it sends and hears nothing more).
    pub crash_pm: u32,
    /// Per use of the fenced resource: the holder's process pauses right after it
    /// checked its lease (300..4000 ms), the moment no lease can see.
    pub pause_holder_pm: u32,
}

/// A deliberately broken store, to show the invariants catch what they claim to.
#[derive(Clone, Copy, Debug, Default)]
pub struct Broken {
    /// `set_if` ignores `expected`: fenced fills become plain sets.
    pub unfenced_set_if: bool,
    /// Notifications are never delivered (and not recorded as faults), so L1 copies
    /// outlive the invalidation window when L1's TTL is longer than it.
    pub mute_notifications: bool,
    /// `try_lock` always takes the lock (`SET` without `NX`): no single flight across
    /// processes.
    pub lock_without_nx: bool,
    /// Lease fencing counters are not raised to the store's clock: after a restart they
    /// start again from 1, below tokens granted before.
    pub unfloored_fences: bool,
}

impl Broken {
    /// A broken store by name: `unfenced`, `mute`, `no-nx`, `no-floor`.
    pub fn named(name: &str) -> Option<Broken> {
        let mut b = Broken::default();
        match name {
            "unfenced" => b.unfenced_set_if = true,
            "mute" => b.mute_notifications = true,
            "no-nx" => b.lock_without_nx = true,
            "no-floor" => b.unfloored_fences = true,
            _ => return None,
        }
        Some(b)
    }
}

/// One simulated system.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub name: &'static str,
    pub procs: usize,
    /// Concurrent callers per process.
    pub actors: usize,
    pub ops_per_actor: usize,
    /// Hot keys (`k0`..).
    pub keys: usize,
    /// Longest pause between two calls of an actor, ms.
    pub think_ms: u64,
    pub l1_ttl_ms: u64,
    pub lock_ttl_ms: u64,
    pub lock_wait_ms: u64,
    /// Lease holders per process, their sessions each, the lock keys (`lock0`..), and
    /// the leases' TTL (a watchdog lease's too).
    pub lockers: usize,
    pub lock_sessions: usize,
    pub lock_keys: usize,
    pub lease_ttl_ms: u64,
    pub faults: FaultRates,
    pub broken: Broken,
    /// The processes run the component's own `cache` export (the portable body) in
    /// wasmtime instead of the native `Corral`.
    pub portable: bool,
    /// The taggers also `clear` (rarely). Off by default: the invariants do not model a
    /// generation's names yet, so a clear's new namespace reads as overwrites.
    pub clears: bool,
}

impl Scenario {
    fn base(name: &'static str) -> Self {
        Scenario {
            name,
            procs: 4,
            actors: 4,
            ops_per_actor: 8,
            keys: 3,
            think_ms: 500,
            l1_ttl_ms: 3_000,
            lock_ttl_ms: 2_000,
            lock_wait_ms: 1_500,
            lockers: 1,
            lock_sessions: 3,
            lock_keys: 2,
            lease_ttl_ms: 1_200,
            faults: FaultRates::default(),
            broken: Broken::default(),
            portable: false,
            clears: false,
        }
    }

    /// No faults: the baseline.
    pub fn calm() -> Self {
        Self::base("calm")
    }

    /// Network faults: delays, lost replies, connections down, lost notifications.
    pub fn network() -> Self {
        let mut s = Self::base("network");
        s.faults = FaultRates {
            delay_pm: 80,
            reply_lost_pm: 30,
            notify_lost_pm: 50,
            down_pm: 250,
            ..FaultRates::default()
        };
        s
    }

    /// Loaders slow, failing and panicking.
    pub fn loaders() -> Self {
        let mut s = Self::base("loaders");
        s.faults = FaultRates {
            loader_slow_pm: 250,
            loader_fail_pm: 100,
            loader_panic_pm: 80,
            ..FaultRates::default()
        };
        s
    }

    /// Everything at once, store restarts and clock steps included.
    pub fn chaos() -> Self {
        let mut s = Self::base("chaos");
        s.procs = 5;
        s.faults = FaultRates {
            delay_pm: 60,
            reply_lost_pm: 25,
            notify_lost_pm: 50,
            down_pm: 200,
            restart_pm: 250,
            clock_pm: 300,
            loader_slow_pm: 150,
            loader_fail_pm: 60,
            loader_panic_pm: 40,
            pause_pm: 100,
            crash_pm: 150,
            pause_holder_pm: 100,
        };
        s
    }

    /// Processes paused past the lock TTLs and resumed, and crashing mid-flight.
    pub fn process() -> Self {
        let mut s = Self::base("process");
        s.faults = FaultRates {
            delay_pm: 30,
            pause_pm: 300,
            crash_pm: 400,
            pause_holder_pm: 250,
            ..FaultRates::default()
        };
        s
    }

    /// The scenarios the suite and the binary cycle through, by seed.
    pub fn all() -> Vec<Scenario> {
        vec![
            Self::calm(),
            Self::network(),
            Self::loaders(),
            Self::chaos(),
            Self::process(),
        ]
    }

    /// A scenario by name (`calm`, `network`, `loaders`, `chaos`, `process`).
    pub fn named(name: &str) -> Option<Scenario> {
        Self::all().into_iter().find(|s| s.name == name)
    }

    /// This scenario run by the portable body (the component's `cache` export): its lease
    /// holders stay out (the leases are the native lock API's).
    pub fn portable(mut self) -> Self {
        self.portable = true;
        self.lockers = 0;
        self
    }

    /// The scenario seed `seed` runs when cycling through [`all`](Self::all).
    pub fn for_seed(seed: u64) -> Scenario {
        let all = Self::all();
        all[(seed % all.len() as u64) as usize].clone()
    }
}
