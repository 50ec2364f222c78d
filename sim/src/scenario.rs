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
    /// Per process and run: its subscription alone drops for 100..2000 ms (commands
    /// flow; notifications to it are lost; it resubscribes and drops its L1 after).
    pub deaf_pm: u32,
    /// Per process and run: its subscription connection goes half-open at some moment
    /// (nothing arrives on it, not even the answer to a health `PING`, and its stream
    /// never ends; new connections work): it must find out by itself and resubscribe.
    pub half_open_pm: u32,
    /// Per run: the store restarts empty once.
    pub restart_pm: u32,
    /// Per process and run: its wall clock is skewed (±300 ms), and, again, stepped
    /// (±500..3000 ms at some moment).
    pub clock_pm: u32,
    /// Per load: slow (300..8000 ms: past the lock TTL, renewed, and past a removal's tombstone), failing, panicking.
    pub loader_slow_pm: u32,
    pub loader_fail_pm: u32,
    pub loader_panic_pm: u32,
    /// Per process and run: it is paused (none of its tasks runs) for 300..4000 ms,
    /// past the flight lock's TTL and a lease's at the top, then resumes.
    pub pause_pm: u32,
    /// Per run: one process crashes (its tasks are dropped mid-flight, its locks left to
    /// expire; it sends and hears nothing more).
    pub crash_pm: u32,
    /// Per run and lease server (Redlock): one server stalls for 300..3000 ms (requests
    /// reach it and are never answered: a minority, the others answer).
    pub stall_pm: u32,
    /// Per use of the fenced resource: the holder's process pauses right after it
    /// checked its lease (300..4000 ms), the moment no lease can see.
    pub pause_holder_pm: u32,
}

/// A deliberately broken store, to show the invariants catch what they claim to.
#[derive(Clone, Copy, Debug, Default)]
pub struct Broken {
    /// Its name on the command line (`--broken NAME`); empty for the real store.
    pub name: &'static str,
    /// `set_if` ignores `expected`: fenced fills become plain sets.
    pub unfenced_set_if: bool,
    /// Notifications are never delivered (and not recorded as faults), so L1 copies
    /// outlive the invalidation window when L1's TTL is longer than it.
    pub mute_notifications: bool,
    /// `try_lock` always takes the lock (`SET` without `NX`): no single flight across
    /// processes.
    pub lock_without_nx: bool,
    /// A planted bug in one of the guest's Lua scripts, which the store runs as given.
    pub patch: Option<Patch>,
}

/// One of the guest's Lua scripts (`corral_core::script`), as the simulated store runs
/// them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Script {
    ReadAndTouch,
    DeleteIfEqual,
    ReplaceIfEqual,
    LockAndPeek,
    FillAndRelease,
    RenewFenced,
    LockAcquire,
    LockAcquireFair,
    LockRelease,
    LockExtend,
}

impl Script {
    /// The script's text, exactly as every body sends it.
    pub fn text(self) -> &'static str {
        use corral_core::script;
        match self {
            Script::ReadAndTouch => script::READ_AND_TOUCH,
            Script::DeleteIfEqual => script::DELETE_IF_EQUAL,
            Script::ReplaceIfEqual => script::REPLACE_IF_EQUAL,
            Script::LockAndPeek => script::LOCK_AND_PEEK,
            Script::FillAndRelease => script::FILL_AND_RELEASE,
            Script::RenewFenced => script::RENEW_FENCED,
            Script::LockAcquire => script::LOCK_ACQUIRE,
            Script::LockAcquireFair => script::LOCK_ACQUIRE_FAIR,
            Script::LockRelease => script::LOCK_RELEASE,
            Script::LockExtend => script::LOCK_EXTEND,
        }
    }
}

/// A small bug planted in a script's text: `find` (which must occur in it) replaced by
/// `replace`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Patch {
    pub script: Script,
    pub find: &'static str,
    pub replace: &'static str,
}

impl Patch {
    /// The patched text.
    ///
    /// # Panics
    /// When `find` is not in the script: the planted bug no longer applies.
    pub fn apply(&self) -> String {
        let text = self.script.text();
        assert!(
            text.contains(self.find),
            "{:?} no longer contains {:?}: the planted bug needs updating",
            self.script,
            self.find
        );
        text.replacen(self.find, self.replace, 1)
    }
}

/// The broken stores, by name, and what each breaks.
pub const BROKEN: &[(&str, &str)] = &[
    ("unfenced", "set_if ignores what it expects: fills are not fenced"),
    ("mute", "notifications are never delivered"),
    ("no-nx", "the flight lock is taken without NX"),
    (
        "no-floor",
        "Lua: the lease acquire does not raise the fencing counter to the store clock",
    ),
    (
        "acquire-no-nx",
        "Lua: the lease acquire takes the lock without NX",
    ),
    (
        "release-unchecked",
        "Lua: the lease release deletes the lock whoever holds it",
    ),
    (
        "extend-unchecked",
        "Lua: the lease extend resets the TTL whoever holds it",
    ),
    (
        "renew-noop",
        "Lua: the flight lock's renewal answers renewed without resetting the TTL",
    ),
    (
        "renew-unfenced",
        "Lua: the flight lock's renewal ignores what the entry holds",
    ),
    (
        "delete-unchecked",
        "Lua: delete-if-equal (flight lock release) deletes whatever is there",
    ),
    (
        "fill-unowned",
        "Lua: fill-and-release fills and releases whoever holds the lock",
    ),
    (
        "fill-unchecked",
        "Lua: fill-and-release writes over whatever the entry holds",
    ),
    (
        "replace-unchecked",
        "Lua: replace-if-equal (fenced fill) writes over whatever is there",
    ),
    (
        "touch-past-absolute",
        "Lua: read-and-touch slides an expiry past the absolute point",
    ),
    ("touch-expired", "Lua: read-and-touch serves an expired entry"),
];

impl Broken {
    /// A broken store by name (see [`BROKEN`]).
    pub fn named(name: &str) -> Option<Broken> {
        let (name, _) = BROKEN.iter().find(|(n, _)| *n == name)?;
        let mut b = Broken {
            name,
            ..Broken::default()
        };
        let patch = |script, find, replace| {
            Some(Patch {
                script,
                find,
                replace,
            })
        };
        match *name {
            "unfenced" => b.unfenced_set_if = true,
            "mute" => b.mute_notifications = true,
            "no-nx" => {
                b.lock_without_nx = true;
                b.patch = patch(Script::LockAndPeek, "'NX', 'PX'", "'PX'");
            }
            "no-floor" => {
                b.patch = patch(
                    Script::LockAcquire,
                    "if below(counter, floor) then",
                    "if false then",
                );
            }
            "acquire-no-nx" => b.patch = patch(Script::LockAcquire, "'NX', 'PX'", "'PX'"),
            "release-unchecked" => {
                b.patch = patch(Script::LockRelease, "if holder == ARGV[1] then", "if holder then");
            }
            "extend-unchecked" => {
                b.patch = patch(Script::LockExtend, "if holder == ARGV[1] then", "if holder then");
            }
            "renew-noop" => {
                b.patch = patch(
                    Script::RenewFenced,
                    "return redis.call('PEXPIRE', KEYS[1], ARGV[2])",
                    "return 1",
                );
            }
            "renew-unfenced" => {
                b.patch = patch(
                    Script::RenewFenced,
                    "return 0 end\nif ARGV[3]",
                    "return 0 end\ndo return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end\nif ARGV[3]",
                )
            }
            "delete-unchecked" => b.patch = patch(Script::DeleteIfEqual, "== ARGV[1] then", "~= nil then"),
            "fill-unowned" => {
                b.patch = patch(
                    Script::FillAndRelease,
                    "if redis.call('GET', KEYS[2]) == ARGV[1] then",
                    "if true then",
                );
            }
            "fill-unchecked" => {
                b.patch = patch(
                    Script::FillAndRelease,
                    "if redis.call('GET', KEYS[1]) == ARGV[3] then",
                    "if true then",
                );
            }
            "replace-unchecked" => b.patch = patch(Script::ReplaceIfEqual, "== ARGV[1] then", "~= nil then"),
            "touch-past-absolute" => {
                b.patch = patch(
                    Script::ReadAndTouch,
                    "if absolute > 0 and absolute < target then target = absolute end",
                    "",
                );
            }
            "touch-expired" => {
                b.patch = patch(Script::ReadAndTouch, "if now >= expires then", "if false then")
            }
            _ => return None,
        }
        Some(b)
    }

    /// The text the store runs for `script`: the guest's, or this store's planted bug.
    pub fn script(&self, script: Script) -> std::borrow::Cow<'static, str> {
        match self.patch {
            Some(p) if p.script == script => std::borrow::Cow::Owned(p.apply()),
            _ => std::borrow::Cow::Borrowed(script.text()),
        }
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
    /// Holders of in-process table locks per process (the native `MemoryLocks`, the
    /// portable `lock` export), with the lease holders' sessions, keys and TTL.
    pub table_lockers: usize,
    /// The servers each lease is taken on: 1, or several for Redlock (a majority holds).
    pub lease_servers: usize,
    pub faults: FaultRates,
    pub broken: Broken,
    /// The processes run the component's own `cache` export (the portable body) in
    /// wasmtime instead of the native `Corral`.
    pub portable: bool,
    /// The taggers also `clear` (rarely). On by default (`--no-clears` turns it off).
    pub clears: bool,
    /// One more actor per process asks for overlapping batches of the hot keys through
    /// `get_or_set_many` (`--batches`).
    pub batches: bool,
    /// The portable processes refresh early (`--refresh`): each builds its cache with
    /// an eager-refresh fraction drawn from its seed, and a batch's entries live 0.8 to
    /// 3 s, so hits fall due for refresh, one key's and a batch's, within a run. (The
    /// native body's single keys draw eager refresh per call; its batches take none.)
    pub refresh: bool,
    /// The portable processes time their loads out (`--timeouts`): each builds its
    /// cache with a hard timeout of 0.3 to 4 s drawn from its seed (its slow loaders run
    /// past it). (The native body's single keys and batches draw theirs per call.)
    pub timeouts: bool,
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
            table_lockers: 2,
            lease_servers: 1,
            faults: FaultRates::default(),
            broken: Broken::default(),
            portable: false,
            clears: true,
            batches: false,
            refresh: false,
            timeouts: false,
        }
    }

    /// No faults: the baseline.
    pub fn calm() -> Self {
        Self::base("calm")
    }

    /// Network faults: delays, lost replies, connections down, a subscription dropped
    /// alone or gone half-open, lost notifications.
    pub fn network() -> Self {
        let mut s = Self::base("network");
        s.faults = FaultRates {
            delay_pm: 80,
            reply_lost_pm: 30,
            notify_lost_pm: 50,
            down_pm: 250,
            deaf_pm: 250,
            half_open_pm: 200,
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
            deaf_pm: 200,
            half_open_pm: 150,
            restart_pm: 250,
            clock_pm: 300,
            loader_slow_pm: 150,
            loader_fail_pm: 60,
            loader_panic_pm: 40,
            pause_pm: 100,
            crash_pm: 150,
            stall_pm: 0,
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

    /// Leases on three servers (Redlock): one may stall, replies get lost, holders
    /// pause past their leases, the store restarts.
    pub fn redlock() -> Self {
        let mut s = Self::base("redlock");
        s.lease_servers = 3;
        s.lockers = 2;
        s.faults = FaultRates {
            delay_pm: 60,
            reply_lost_pm: 30,
            restart_pm: 100,
            pause_pm: 150,
            pause_holder_pm: 250,
            stall_pm: 600,
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
            Self::redlock(),
        ]
    }

    /// A scenario by name (`calm`, `network`, `loaders`, `chaos`, `process`, `redlock`).
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
