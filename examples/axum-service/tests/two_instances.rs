//! Two instances of the example service on one real `redis-server`: what a service
//! developer relies on, end to end over HTTP.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use corral_tests::RedisServer;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;

/// Two instances of the service over one Redis and one "database" directory.
struct Pair {
    a: Service,
    b: Service,
    data: PathBuf,
    redis: RedisServer,
}

impl Pair {
    fn start(name: &str) -> Result<Pair> {
        let redis = RedisServer::start()?;
        let data = std::env::temp_dir().join(format!("axum-service-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&data);
        Ok(Pair {
            a: Service::start(&redis.url(), &data)?,
            b: Service::start(&redis.url(), &data)?,
            data,
            redis,
        })
    }

    /// Database reads of both instances together.
    async fn db_reads(&self) -> Result<u64> {
        Ok(self.a.stats().await?["db_reads"].as_u64().context("db_reads")?
            + self.b.stats().await?["db_reads"].as_u64().context("db_reads")?)
    }

    /// A cache counter of both instances together.
    async fn cache_counter(&self, name: &str) -> Result<u64> {
        let of = |stats: Value| stats["cache"][name].as_u64().context("a cache counter");
        Ok(of(self.a.stats().await?)? + of(self.b.stats().await?)?)
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

/// One running instance of the example binary. Dropping it kills it.
struct Service {
    child: Child,
    addr: SocketAddr,
}

impl Service {
    /// Starts an instance on a free port and waits for its `listening on` line.
    fn start(redis: &str, data: &std::path::Path) -> Result<Service> {
        let mut child = Command::new(env!("CARGO_BIN_EXE_axum-service"))
            .args(["--redis", redis, "--port", "0", "--data"])
            .arg(data)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawning the example service")?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        // Reads the first line, then drains whatever else comes until the child ends.
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            lines.for_each(drop);
        });
        let mut service = Service {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
        };
        let line = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(Some(Ok(line))) => line,
            Ok(_) => bail!("the service ended before it listened"),
            Err(_) => bail!("the service did not listen within 60 s"),
        };
        service.addr = line
            .strip_prefix("listening on http://")
            .with_context(|| format!("not a listening line: {line:?}"))?
            .parse()?;
        Ok(service)
    }

    async fn get(&self, path: &str) -> Result<(u16, String)> {
        http(self.addr, "GET", path, "").await
    }

    async fn stats(&self) -> Result<Value> {
        let (status, body) = self.get("/stats").await?;
        ensure!(status == 200, "GET /stats: {status} {body}");
        Ok(serde_json::from_str(&body)?)
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request on a connection of its own, bounded by 30 s: the status and the
/// body.
async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> Result<(u16, String)> {
    let exchange = async {
        let mut stream = TcpStream::connect(addr).await?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await?;
        let (head, body) = response.split_once("\r\n\r\n").context("a response head")?;
        let status = head.split(' ').nth(1).context("a status line")?.parse()?;
        anyhow::Ok((status, body.to_owned()))
    };
    tokio::time::timeout(Duration::from_secs(30), exchange)
        .await
        .with_context(|| format!("{method} {path} on {addr} took over 30 s"))?
}

async fn put_user(service: &Service, id: u64, name: &str) -> Result<()> {
    let body = serde_json::json!({ "name": name }).to_string();
    let (status, reply) = http(service.addr, "PUT", &format!("/users/{id}"), &body).await?;
    ensure!(status == 200, "PUT /users/{id}: {status} {reply}");
    Ok(())
}

/// `requests` concurrent GETs of `path`, alternating between the two instances: each
/// reply's status and body.
async fn stampede(pair: &Pair, path: &str, requests: usize) -> Result<Vec<(u16, String)>> {
    let mut calls = JoinSet::new();
    for i in 0..requests {
        let addr = if i % 2 == 0 { pair.a.addr } else { pair.b.addr };
        let path = path.to_owned();
        calls.spawn(async move { http(addr, "GET", &path, "").await });
    }
    let mut replies = Vec::with_capacity(requests);
    while let Some(reply) = calls.join_next().await {
        replies.push(reply??);
    }
    Ok(replies)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_stampede_across_two_instances_costs_one_database_call() -> Result<()> {
    let _real_time = corral_tests::real_time().await;
    let pair = Pair::start("stampede")?;
    put_user(&pair.a, 42, "Ada").await?;
    ensure!(pair.db_reads().await? == 0, "a PUT reads nothing");

    let started = Instant::now();
    let replies = stampede(&pair, "/users/42", 200).await?;
    let took = started.elapsed();
    for (status, body) in &replies {
        assert_eq!(*status, 200, "{body}");
        let user: Value = serde_json::from_str(body)?;
        assert_eq!(user["name"], "Ada", "{body}");
    }
    let db_reads = pair.db_reads().await?;
    println!(
        "200 concurrent GETs over two instances: {db_reads} database call(s) in {took:?}; \
         coalesced in process {}, waited on another process's lock {}, L2 hits {}",
        pair.cache_counter("coalesced").await?,
        pair.cache_counter("lock_waits").await?,
        pair.cache_counter("l2_hits").await?,
    );
    assert_eq!(db_reads, 1, "one database call for both instances together");
    Ok(())
}

/// The value of the Prometheus sample `series` (name and labels as rendered) in `text`.
fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

/// Each instance's `/metrics` is Prometheus text with Corral's counters, and they count
/// what `/stats` counts: one load in all, the other instance's read an L2 hit, a second
/// read an L1 hit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_instances_export_corrals_counters_for_prometheus() -> Result<()> {
    let _real_time = corral_tests::real_time().await;
    let pair = Pair::start("metrics")?;
    put_user(&pair.a, 7, "Grace").await?;
    for (service, path) in [
        (&pair.a, "/users/7"),
        (&pair.a, "/users/7"),
        (&pair.b, "/users/7"),
    ] {
        let (status, body) = service.get(path).await?;
        ensure!(status == 200, "GET {path}: {status} {body}");
    }
    let mut loads = 0.0;
    for (name, service) in [("a", &pair.a), ("b", &pair.b)] {
        let (status, text) = service.get("/metrics").await?;
        ensure!(status == 200, "GET /metrics on {name}: {status} {text}");
        ensure!(
            text.contains("# TYPE corral_cache_loads_total counter"),
            "{name}: no counter type line in\n{text}"
        );
        let stats = service.stats().await?;
        for (series, counter) in [
            (r#"corral_cache_loads_total{prefix="corral:"}"#, "loads"),
            (
                r#"corral_cache_hits_total{prefix="corral:",tier="l1"}"#,
                "l1_hits",
            ),
            (
                r#"corral_cache_hits_total{prefix="corral:",tier="l2"}"#,
                "l2_hits",
            ),
        ] {
            let exported =
                sample(&text, series).with_context(|| format!("{name}: no {series} in\n{text}"))?;
            let counted = stats["cache"][counter].as_u64().context("a cache counter")?;
            ensure!(
                exported == counted as f64,
                "{name}: {series} is {exported}, /stats says {counter} = {counted}"
            );
        }
        loads += sample(&text, r#"corral_cache_loads_total{prefix="corral:"}"#).unwrap_or_default();
    }
    ensure!(loads == 1.0, "one load over both instances, exported {loads}");
    ensure!(
        sample(
            &pair.a.get("/metrics").await?.1,
            r#"corral_cache_hits_total{prefix="corral:",tier="l1"}"#
        ) >= Some(1.0),
        "a's second read was an L1 hit"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_through_one_instance_is_seen_by_the_other() -> Result<()> {
    let _real_time = corral_tests::real_time().await;
    let pair = Pair::start("update")?;
    put_user(&pair.a, 7, "Ada").await?;
    // B loads the user and keeps it in its L1; a second read is served from there.
    for _ in 0..2 {
        let (status, body) = pair.b.get("/users/7").await?;
        ensure!(status == 200 && body.contains("\"Ada\""), "{status} {body}");
    }
    ensure!(
        pair.b.stats().await?["cache"]["l1_hits"].as_u64() >= Some(1),
        "B serves the user from its L1"
    );

    let invalidations = |stats: Value| stats["cache"]["l1_invalidations"].as_u64().context("a counter");
    let before = invalidations(pair.b.stats().await?)?;
    put_user(&pair.a, 7, "Grace").await?;
    let written = Instant::now();
    // A bounded poll: B drops its L1 copy when A's announcement reaches it.
    let mut polls = 0;
    let heard_after = loop {
        polls += 1;
        if invalidations(pair.b.stats().await?)? > before {
            break written.elapsed();
        }
        ensure!(
            written.elapsed() < Duration::from_secs(10),
            "B has not heard of A's PUT 10 s after it returned"
        );
        tokio::task::yield_now().await;
    };
    let (status, body) = pair.b.get("/users/7").await?;
    let served_after = written.elapsed();
    ensure!(
        status == 200 && body.contains("\"Grace\""),
        "B's next GET: {status} {body}"
    );
    println!(
        "B heard of A's PUT {heard_after:?} after it returned ({polls} poll(s) of B's /stats); \
         B's next GET served the new name {served_after:?} after it (a reload from the database)"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_user_is_a_404_for_the_leader_and_every_coalesced_caller() -> Result<()> {
    let _real_time = corral_tests::real_time().await;
    let pair = Pair::start("missing")?;
    let replies = stampede(&pair, "/users/404404", 40).await?;
    for (status, body) in &replies {
        assert_eq!(*status, 404, "{body}");
        assert_eq!(body, "no user 404404");
    }
    let (db_reads, coalesced) = (pair.db_reads().await?, pair.cache_counter("coalesced").await?);
    println!(
        "40 concurrent GETs of a missing user: 40 x 404, {db_reads} database call(s), {coalesced} coalesced caller(s)"
    );
    // The absence is remembered (30 s): one instance asks, or each once should they
    // miss at the same moment.
    assert!(db_reads <= 2, "{db_reads} database calls");
    assert!(
        coalesced > 0,
        "some of the 404s went to callers that waited on a leader"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reports_on_both_instances_take_turns_under_rising_fencing_tokens() -> Result<()> {
    let _real_time = corral_tests::real_time().await;
    let pair = Pair::start("report")?;
    let started = Instant::now();
    let (a, b) = tokio::join!(
        http(pair.a.addr, "POST", "/report", ""),
        http(pair.b.addr, "POST", "/report", "")
    );
    let took = started.elapsed();
    let mut tokens = Vec::new();
    for (status, body) in [a?, b?] {
        ensure!(status == 200, "{status} {body}");
        let token: u64 = body
            .trim()
            .rsplit(' ')
            .next()
            .and_then(|t| t.parse().ok())
            .with_context(|| format!("a fencing token in {body:?}"))?;
        tokens.push(token);
    }
    println!("two 300 ms reports, one per instance, one lock: {took:?} in all, tokens {tokens:?}");
    assert_ne!(tokens[0], tokens[1], "each lease has its own token");
    Ok(())
}

/// `/ready` is 200 on both instances while Redis answers, 503 saying why while it is
/// frozen (SIGSTOP), and 200 again once it resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_instances_are_ready_and_say_so_when_redis_freezes() -> Result<()> {
    let _real_time = corral_tests::real_time().await;
    let pair = Pair::start("ready")?;
    for service in [&pair.a, &pair.b] {
        let (status, body) = service.get("/ready").await?;
        ensure!(status == 200 && body == "ready", "{status} {body}");
    }
    pair.redis.pause()?;
    let frozen = pair.a.get("/ready").await;
    pair.redis.resume()?;
    let (status, body) = frozen?;
    ensure!(
        status == 503 && body.contains("L2 unreachable"),
        "{status} {body}"
    );
    let deadline = Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (status, body) = pair.a.get("/ready").await?;
        if status == 200 {
            break;
        }
        ensure!(Instant::now() < deadline, "never ready again: {status} {body}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Overlapping lists over two instances: every user is read from the database once in
/// all, in batches (one query per instance that leads some of them); an unknown id is
/// `null` in its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_lists_read_each_user_once() -> Result<()> {
    let _real_time = corral_tests::real_time().await;
    let pair = Pair::start("lists")?;
    for id in 1..=6 {
        put_user(&pair.a, id, &format!("user {id}")).await?;
    }
    let mut calls = JoinSet::new();
    for i in 0..40 {
        let addr = if i % 2 == 0 { pair.a.addr } else { pair.b.addr };
        // Lists of three neighbours, all overlapping; 99 is unknown.
        let first = 1 + i % 5;
        let path = format!("/users?ids={},{},99,{}", first, first + 1, (first + 2).min(6));
        calls.spawn(async move { http(addr, "GET", &path, "").await.map(|reply| (path, reply)) });
    }
    while let Some(reply) = calls.join_next().await {
        let (path, (status, body)) = reply??;
        ensure!(status == 200, "{path}: {status} {body}");
        let users: Vec<Value> = serde_json::from_str(&body)?;
        ensure!(users.len() == 4 && users[2].is_null(), "{path}: {body}");
        ensure!(
            users[0]["name"].as_str().is_some_and(|n| n.starts_with("user ")),
            "{path}: {body}"
        );
    }
    let db_reads = pair.db_reads().await?;
    println!("40 overlapping lists over two instances: {db_reads} database queries");
    // Seven ids (six users and the unknown one), each read once across both
    // instances: at most seven queries, fewer as ids that miss together share one.
    ensure!(db_reads <= 7, "each id once, in batches: {db_reads} queries");
    // The list remembered 99 as unknown (a JSON null for 30 s): its own endpoint reads
    // that as a 404, on both instances, without a query (before, a 500: `Corrupt`).
    for instance in [&pair.a, &pair.b] {
        let (status, body) = instance.get("/users/99").await?;
        ensure!(status == 404, "an unknown user after a list: {status} {body}");
    }
    ensure!(
        pair.db_reads().await? == db_reads,
        "the remembered absence was read"
    );
    let (status, body) = pair.a.get("/users?ids=1,x").await?;
    ensure!(status == 400, "a bad id is a bad request: {status} {body}");
    Ok(())
}
