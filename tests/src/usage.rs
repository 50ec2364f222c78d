//! What this process has used so far, for the benches' single-contender runs: CPU time
//! and context switches, read from `/proc` (0 where it cannot be read).

/// This process's CPU seconds so far (user + sys, in the kernel's ticks of 10 ms).
pub fn client_cpu() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command's name, which is in parentheses.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, fields)| fields)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// Context switches of this process's threads so far, voluntary or not.
pub fn context_switches() -> u64 {
    let Ok(threads) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    threads
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .map(|status| {
            status
                .lines()
                .filter(|l| l.contains("ctxt_switches"))
                .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}
