//! `corral-sim [--seeds N] [--from S0] [--seed S] [--scenario NAME] [--procs P] [--keys K]
//! [--callers C] [--portable] [--broken NAME] [--no-clears] [--batches] [--refresh] [--timeouts] [--trace] [--twice] [--stop]`
//!
//! Runs N seeds (cycling through the scenarios unless one is named), or one seed, and
//! ends with a table. A failing seed prints its replay command and its trace; `--stop`
//! ends the run there.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Instant;

use corral_sim::{Scenario, Totals, run_seed};

struct Args {
    seeds: u64,
    first: u64,
    single: Option<u64>,
    procs: Option<usize>,
    keys: Option<usize>,
    callers: Option<usize>,
    scenario: Option<String>,
    trace: bool,
    twice: bool,
    portable: bool,
    clears: bool,
    batches: bool,
    refresh: bool,
    timeouts: bool,
    stop: bool,
    broken: Option<String>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seeds: 1_000,
        first: 0,
        single: None,
        procs: None,
        keys: None,
        callers: None,
        scenario: None,
        trace: false,
        twice: false,
        portable: false,
        clears: true,
        batches: false,
        refresh: false,
        timeouts: false,
        stop: false,
        broken: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match flag.as_str() {
            "--seeds" => a.seeds = value("--seeds")?.parse().map_err(|e| format!("--seeds: {e}"))?,
            "--from" => a.first = value("--from")?.parse().map_err(|e| format!("--from: {e}"))?,
            "--seed" => a.single = Some(value("--seed")?.parse().map_err(|e| format!("--seed: {e}"))?),
            "--procs" => a.procs = Some(value("--procs")?.parse().map_err(|e| format!("--procs: {e}"))?),
            "--keys" => a.keys = Some(value("--keys")?.parse().map_err(|e| format!("--keys: {e}"))?),
            "--callers" => {
                a.callers = Some(
                    value("--callers")?
                        .parse()
                        .map_err(|e| format!("--callers: {e}"))?,
                )
            }
            "--scenario" => a.scenario = Some(value("--scenario")?),
            "--trace" => a.trace = true,
            "--twice" => a.twice = true,
            "--portable" => a.portable = true,
            "--no-clears" => a.clears = false,
            "--batches" => a.batches = true,
            "--refresh" => a.refresh = true,
            "--timeouts" => a.timeouts = true,
            "--stop" => a.stop = true,
            "--broken" => a.broken = Some(value("--broken")?),
            "-h" | "--help" => {
                return Err(
                    "usage: corral-sim [--seeds N] [--from S0] [--seed S] [--procs P] [--keys K] [--callers C] \
                            [--scenario calm|network|loaders|chaos|process|redlock] \
                            [--broken NAME] [--portable] [--no-clears] [--batches] [--refresh] [--timeouts] [--trace] [--twice] [--stop]"
                        .into(),
                );
            }
            other => return Err(format!("unknown argument {other}; try --help")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let scenario_for = |seed: u64| -> Scenario {
        let mut s = match &args.scenario {
            Some(name) => Scenario::named(name).unwrap_or_else(|| {
                eprintln!("unknown scenario {name}");
                std::process::exit(64)
            }),
            None => Scenario::for_seed(seed),
        };
        if let Some(b) = &args.broken {
            s.broken = corral_sim::Broken::named(b).unwrap_or_else(|| {
                eprintln!("unknown broken store {b}; one of:");
                for (name, what) in corral_sim::BROKEN {
                    eprintln!("  {name:<18} {what}");
                }
                std::process::exit(64)
            });
        }
        if args.portable {
            s = s.portable();
        }
        s.clears = args.clears;
        s.batches = args.batches;
        s.refresh = args.refresh;
        s.timeouts = args.timeouts;
        if let Some(k) = args.keys {
            s.keys = k.max(1);
        }
        if let Some(c) = args.callers {
            s.actors = c.max(1);
        }
        if let Some(p) = args.procs {
            s.procs = p;
        }
        s
    };
    let seeds: Vec<u64> = match args.single {
        Some(s) => vec![s],
        None => (args.first..args.first + args.seeds).collect(),
    };
    let mut totals = Totals::default();
    let started = Instant::now();
    let mut failed_traces = 0;
    for (i, &seed) in seeds.iter().enumerate() {
        let scenario = scenario_for(seed);
        let outcome = run_seed(&scenario, seed);
        if args.twice {
            let again = run_seed(&scenario, seed);
            if again.trace != outcome.trace {
                totals.nondeterministic.push(seed);
                let at = outcome
                    .trace
                    .lines()
                    .zip(again.trace.lines())
                    .position(|(a, b)| a != b);
                let (a, b) = at.map_or(("", ""), |i| {
                    (
                        outcome.trace.lines().nth(i).unwrap_or(""),
                        again.trace.lines().nth(i).unwrap_or(""),
                    )
                });
                eprintln!("\nseed {seed}: the second run traced otherwise:\n  first:  {a}\n  second: {b}");
            }
        }
        totals.add(&outcome);
        if args.trace {
            print!("{}", outcome.trace);
        }
        if !outcome.violations.is_empty() {
            eprintln!("\nseed {seed} ({}) FAILED:", outcome.scenario);
            for v in &outcome.violations {
                eprintln!("  {v}");
            }
            eprintln!("replay: {}", outcome.replay_command());
            if !args.trace && failed_traces < 3 {
                failed_traces += 1;
                eprint!("{}", outcome.trace);
            }
            if args.stop {
                eprintln!("stopped at the first failing seed: {seed} ({} seeds run)", i + 1);
                break;
            }
        }
        if seeds.len() > 1 && (i + 1) % 50 == 0 {
            let rate = (i + 1) as f64 / started.elapsed().as_secs_f64();
            eprint!(
                "\r{}/{} seeds, {:.0} seeds/s, {} violations   ",
                i + 1,
                seeds.len(),
                rate,
                totals.violations
            );
            let _ = std::io::stderr().flush();
        }
    }
    let secs = started.elapsed().as_secs_f64();
    eprintln!();
    println!("{}", totals.table());
    println!(
        "{} seeds in {:.1} s: {:.1} seeds/s",
        totals.seeds,
        secs,
        totals.seeds as f64 / secs
    );
    if totals.failing.is_empty() && totals.nondeterministic.is_empty() {
        ExitCode::SUCCESS
    } else {
        for (seed, scenario, first) in &totals.failing {
            println!("FAIL seed {seed} ({scenario}): {first}");
        }
        ExitCode::FAILURE
    }
}
