//! Corral in a web service: an axum app whose instances share one Redis.
//!
//! - `GET /users/{id}`: the user, through `get_or_set_json` in front of a slow database
//!   (200 ms a query). However many requests miss at once, on however many instances,
//!   the database sees one query.
//! - `GET /users?ids=1,2,3`: a list, through `get_or_set_many_json`: the users no
//!   cache holds are read from the database in one query (one per instance that leads
//!   some of them), and each user once across every instance, however the lists of
//!   concurrent requests overlap. A user the database lacks is `null` in the list (and
//!   remembered as such for 30 s).
//! - `PUT /users/{id}` with `{"name": ".."}`: writes the database, then removes the cached
//!   copy (invalidate on write). Every instance serves the new row from then on.
//! - `POST /report`: one instance at a time, under a Redis lease with a fencing token.
//! - `GET /stats`: database queries and the cache's counters; `GET /health`; `GET /ready`
//!   (the cache's readiness: 503 while Redis cannot be reached); `GET /metrics`: every
//!   counter Corral keeps, in Prometheus text (`metrics-exporter-prometheus`, the recorder
//!   of the `metrics` facade Corral counts through).
//!
//! ```sh
//! redis-server --port 6379 --save '' &
//! cargo run -p axum-service -- --redis redis://127.0.0.1:6379 --port 3000 &
//! cargo run -p axum-service -- --redis redis://127.0.0.1:6379 --port 3001 &
//! curl -X PUT localhost:3000/users/42 -H 'content-type: application/json' -d '{"name":"Ada"}'
//! curl localhost:3001/users/42
//! ```

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use corral::locks::LockOptions;
use corral::{Corral, ErrorKind, LoadOptions};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use serde::{Deserialize, Serialize};

/// How long a user stays cached (a `PUT` removes it sooner).
const USER_TTL: Duration = Duration::from_secs(300);
/// How long an unknown id is remembered as unknown by `GET /users?ids=..`.
const UNKNOWN_TTL: Duration = Duration::from_secs(30);
/// How long `POST /report` waits for another instance's report to finish.
const REPORT_WAIT: Duration = Duration::from_secs(5);
/// How often the Prometheus recorder's histograms are trimmed.
const METRICS_UPKEEP: Duration = Duration::from_secs(5);

#[derive(Parser, Debug)]
struct Args {
    /// The Redis every instance shares; without it, an in-process store (one instance).
    #[arg(long, env = "CORRAL_REDIS")]
    redis: Option<String>,
    /// The port to listen on (0: any free one; the line `listening on ...` says which).
    #[arg(long, default_value_t = 3000)]
    port: u16,
    /// Where the "database" keeps its rows (shared by the instances of one machine).
    #[arg(long, default_value_os_t = std::env::temp_dir().join("corral-axum-service"))]
    data: PathBuf,
}

/// What every handler gets: cheap to clone (a `Corral` is an `Arc` inside).
#[derive(Clone, Debug)]
struct App {
    cache: Corral,
    db: Arc<Database>,
    metrics: PrometheusHandle,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    tracing_subscriber::fmt().with_writer(io::stderr).init();
    // Before the cache is built: it registers its counters with the recorder installed then.
    let metrics = PrometheusBuilder::new().install_recorder()?;
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut every = tokio::time::interval(METRICS_UPKEEP);
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });

    let mut builder = Corral::builder();
    if let Some(url) = &args.redis {
        builder = builder.redis(url);
    }
    let cache = builder.build()?;
    let app = App {
        cache: cache.clone(),
        db: Arc::new(Database::open(args.data)?),
        metrics,
    };
    let router = Router::new()
        .route("/users", get(list_users))
        .route("/users/{id}", get(get_user).put(put_user))
        .route("/report", post(make_report))
        .route("/stats", get(stats))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(prometheus))
        .with_state(app);

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // No request is under way any more: let what they left (a load completing in the
    // background, a removal or an announcement retried) end before the process does.
    if let Err(e) = cache.close(Duration::from_secs(5)).await {
        tracing::warn!(error = %e, "shutting down with work left");
    }
    Ok(())
}

/// `GET /users/{id}`: from the cache, or from the database once for every caller that
/// misses at the same time, in this process and in every other one. A user the database
/// lacks is a `None`, remembered for 30 s as the list remembers it (both read the key as
/// an `Option<User>`: the remembered absence is JSON `null`), and a 404.
async fn get_user(State(app): State<App>, Path(id): Path<u64>) -> Result<Json<User>, ApiError> {
    let options = LoadOptions::relative(USER_TTL).cache_none_for(UNKNOWN_TTL);
    let user: Option<User> = app
        .cache
        .get_or_set_json(&user_key(id), options, || async {
            match app.db.user(id).await {
                Err(e) if e.is::<NotFound>() => Ok(None),
                found => found.map(Some),
            }
        })
        .await?;
    user.map(Json)
        .ok_or_else(|| ApiError(StatusCode::NOT_FOUND, NotFound(id).to_string()))
}

/// `GET /users?ids=1,2,3`: the users in order, `null` for an unknown id. The ids no
/// cache tier holds are loaded in one database query, each once across every caller
/// and every instance.
async fn list_users(
    State(app): State<App>,
    uri: axum::http::Uri,
) -> Result<Json<Vec<Option<User>>>, ApiError> {
    let ids = uri
        .query()
        .and_then(|q| q.split('&').find_map(|pair| pair.strip_prefix("ids=")))
        .ok_or_else(|| ApiError::bad_request("give the ids: /users?ids=1,2,3"))?;
    let ids: Vec<u64> = ids
        .split(',')
        .map(|id| id.trim().parse())
        .collect::<Result<_, _>>()
        .map_err(|_| ApiError::bad_request("ids must be numbers separated by commas"))?;
    let keys: Vec<String> = ids.iter().map(|&id| user_key(id)).collect();
    let users = app
        .cache
        .get_or_set_many_json(
            &keys,
            LoadOptions::relative(USER_TTL)
                .max_batch(100)
                .cache_none_for(UNKNOWN_TTL),
            |keys| {
                let db = app.db.clone();
                async move {
                    let ids: Vec<u64> = keys.iter().filter_map(|k| id_of(k)).collect();
                    let found = db.users(&ids).await?;
                    Ok::<_, BoxError>(found.into_iter().map(|u| (user_key(u.id), u)))
                }
            },
        )
        .await?;
    let users = users.into_iter().collect::<corral::Result<Vec<_>>>()?;
    Ok(Json(users))
}

/// `PUT /users/{id}`: the database first, then the cache. `remove` returns once the
/// change is announced: the other instances drop their in-process copy as the
/// announcement reaches them (milliseconds), and the next read anywhere loads the new
/// row. Should `remove` fail (a 503), the row is written but the old value may be
/// served until it expires: the client retries the PUT, which is idempotent.
async fn put_user(
    State(app): State<App>,
    Path(id): Path<u64>,
    Json(change): Json<UserChange>,
) -> Result<Json<User>, ApiError> {
    let user = User {
        id,
        name: change.name,
    };
    app.db.save(&user).await.map_err(ApiError::internal)?;
    app.cache.remove(&user_key(id)).await?;
    Ok(Json(user))
}

/// `POST /report`: one report at a time across every instance. The lease's fencing
/// token goes to the resource, which refuses a token older than the last it saw (a
/// paused holder whose lease lapsed cannot overwrite a newer report).
async fn make_report(State(app): State<App>) -> Result<String, ApiError> {
    let Some(locks) = app.cache.locks().redis() else {
        return fail(StatusCode::SERVICE_UNAVAILABLE, "reports need --redis");
    };
    let options = LockOptions::new().wait(REPORT_WAIT);
    let lease = match locks.acquire("report", options).await {
        Ok(lease) => lease,
        Err(e) if e.kind() == ErrorKind::Timeout => {
            return fail(StatusCode::CONFLICT, "another report is being made");
        }
        Err(e) => return Err(e.into()), // Redis unreachable: 503
    };
    let token = lease.fencing_token();
    tokio::select! {
        written = app.db.write_report(token) => written.map_err(ApiError::internal)?,
        () = lease.lost() => return fail(StatusCode::SERVICE_UNAVAILABLE, "lost the report's lock"),
    }
    if let Err(e) = lease.release().await {
        tracing::warn!("report lock not released (it lapses by its TTL): {e}");
    }
    Ok(format!("report written with fencing token {token}\n"))
}

/// `GET /stats`: what the database was asked, and what the cache did.
async fn stats(State(app): State<App>) -> Json<serde_json::Value> {
    Json(serde_json::json!({
        "db_reads": app.db.reads.load(Ordering::Relaxed),
        "cache": app.cache.metrics(),
    }))
}

/// Readiness for a load balancer: 200 when the cache's L2 answers and its subscription
/// is up, else 503 saying what is wrong (the service still answers, from the database).
async fn ready(State(app): State<App>) -> (StatusCode, String) {
    let health = app.cache.health().await;
    let status = if health.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, health.to_string())
}

/// `GET /metrics`: the counters in Prometheus text (version 0.0.4 of its format).
async fn prometheus(State(app): State<App>) -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(),
    )
}

fn user_key(id: u64) -> String {
    format!("user:{id}")
}

/// The id a user's key names.
fn id_of(key: &str) -> Option<u64> {
    key.strip_prefix("user:")?.parse().ok()
}

/// An error as an HTTP response.
#[derive(Debug)]
struct ApiError(StatusCode, String);

fn fail<T>(status: StatusCode, message: &str) -> Result<T, ApiError> {
    Err(ApiError(status, message.to_owned()))
}

impl ApiError {
    fn internal(e: impl std::fmt::Display) -> Self {
        ApiError(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
    }

    fn bad_request(why: &str) -> Self {
        ApiError(StatusCode::BAD_REQUEST, why.to_owned())
    }
}

/// Corral's errors by kind; a loader's own error is there to downcast, for the caller
/// that ran the loader and for every caller that waited on it alike.
impl From<corral::Error> for ApiError {
    fn from(e: corral::Error) -> Self {
        let status = match e.kind() {
            _ if e.loader_error::<NotFound>().is_some() => StatusCode::NOT_FOUND,
            ErrorKind::InvalidArgument => StatusCode::BAD_REQUEST, // a bad key or value
            ErrorKind::Loader => StatusCode::BAD_GATEWAY,          // the database failed
            _ if e.is_retryable() => StatusCode::SERVICE_UNAVAILABLE, // Unavailable, Timeout, Quorum
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        // Display names the root cause: "store unavailable: get: redis GET failed: Connection refused".
        ApiError(status, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.0, self.1).into_response()
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
struct User {
    id: u64,
    name: String,
}

#[derive(Debug, Deserialize)]
struct UserChange {
    name: String,
}

/// The database's answer for a user it does not have: a 404.
#[derive(Debug, thiserror::Error)]
#[error("no user {0}")]
struct NotFound(u64);

/// The stand-in for a real database: a row per file in a directory the instances
/// share, and 200 ms per query.
#[derive(Debug)]
struct Database {
    dir: PathBuf,
    reads: AtomicU64,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Database {
    fn open(dir: PathBuf) -> io::Result<Self> {
        std::fs::create_dir_all(&dir)?;
        Ok(Database {
            dir,
            reads: AtomicU64::new(0),
        })
    }

    /// A slow query: the user, or `NotFound`.
    async fn user(&self, id: u64) -> Result<User, BoxError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let path = self.dir.join(format!("{id}.json"));
        match tokio::task::spawn_blocking(move || std::fs::read(path)).await? {
            Ok(row) => Ok(serde_json::from_slice(&row)?),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Err(NotFound(id).into()),
            Err(e) => Err(e.into()),
        }
    }

    /// One slow query for many users: those it finds (an unknown id is left out).
    async fn users(&self, ids: &[u64]) -> Result<Vec<User>, BoxError> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let dir = self.dir.clone();
        let ids = ids.to_vec();
        let rows = tokio::task::spawn_blocking(move || {
            let mut found = Vec::new();
            for id in ids {
                match std::fs::read(dir.join(format!("{id}.json"))) {
                    Ok(row) => found.push(serde_json::from_slice(&row)?),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(BoxError::from(e)),
                }
            }
            Ok(found)
        });
        rows.await?
    }

    async fn save(&self, user: &User) -> io::Result<()> {
        let row = serde_json::to_vec(user)?;
        let path = self.dir.join(format!("{}.json", user.id));
        let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
        tokio::task::spawn_blocking(move || {
            std::fs::write(&tmp, row)?;
            std::fs::rename(&tmp, &path) // readers see the old row or the new one, whole
        })
        .await?
    }

    /// 300 ms of work, then the report, unless a report under a newer fencing token
    /// was written meanwhile (a real database checks the token in the write's
    /// transaction).
    async fn write_report(&self, token: u64) -> io::Result<()> {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let path = self.dir.join("report.token");
        tokio::task::spawn_blocking(move || {
            let last: u64 = std::fs::read_to_string(&path).map_or(0, |s| s.parse().unwrap_or(0));
            if token < last {
                return Err(io::Error::other(format!(
                    "token {token} refused: {last} wrote since"
                )));
            }
            std::fs::write(&path, token.to_string())
        })
        .await?
    }
}
