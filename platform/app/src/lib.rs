//! The example application for wasm platforms: a `wasi:http` handler that serves
//! `GET /items/{id}` cache-aside over a slow origin, through Corral's two-phase
//! get-or-set (`cache.begin`, then, when it leads, an outgoing `wasi:http` request to the
//! origin and the end of the `load`), and `PUT /items/{id}` as a write. Composed with
//! `corral-wasi.wasm` (scripts/platform), the application imports only `wasi:*`.
//!
//! Responses: 200 with the value; headers `x-corral` (`hit`: the value was there, or
//! another caller's load brought it; `loaded`: this request loaded it from the origin)
//! and `x-corral-again` (`hit` when a second read of the id within the same request was
//! served by the cache). The origin is `http://$CORRAL_EXAMPLE_ORIGIN/items/{id}`
//! (default `127.0.0.1:8081`); entries live 60 s, and the L1 TTL is 1 s: another
//! instance serves a write within it, plus one read in flight when the write landed (no
//! platform announces changes). A due eager refresh (not configured here) would run in
//! the request that found it, before the answer.

#![cfg(target_arch = "wasm32")]

/// The generated bindings. The canonical-ABI glue they contain is `unsafe` by nature;
/// it is allowed here and nowhere else.
#[allow(unsafe_code)]
mod bindings {
    wit_bindgen::generate!({
        path: "wit",
        world: "corral:example-app/app",
        generate_all,
    });

    use super::App;
    export!(App);
}

use bindings::corral::cache::cache::{self, Begun, Followed, Load};
use bindings::corral::cache::types::{EntryOptions, Error};
use bindings::exports::wasi::http::incoming_handler;
use bindings::wasi::http::outgoing_handler;
use bindings::wasi::http::types::{
    Fields, IncomingBody, IncomingRequest, Method, OutgoingBody, OutgoingRequest, OutgoingResponse,
    ResponseOutparam, Scheme,
};
use bindings::wasi::io::streams::StreamError;

struct App;

/// Where the origin listens, unless `CORRAL_EXAMPLE_ORIGIN` says otherwise.
const DEFAULT_ORIGIN: &str = "127.0.0.1:8081";
/// How long an item is fresh.
const ITEM_TTL_MS: u64 = 60_000;
/// How long an instance serves an item from L1 without asking the store: the bound
/// within which another instance serves a write.
const L1_TTL_MS: u64 = 1_000;

fn options() -> EntryOptions {
    EntryOptions {
        absolute_ms: None,
        relative_ms: Some(ITEM_TTL_MS),
        sliding_ms: None,
        max_stale_ms: None,
    }
}

/// Sets this instance's settings once: the defaults, with a short L1 TTL. A failure is
/// every request's answer (503): without it the documented bound would not hold.
fn configure() -> Result<(), Error> {
    use std::sync::OnceLock;
    static CONFIGURED: OnceLock<Result<(), Error>> = OnceLock::new();
    CONFIGURED
        .get_or_init(|| {
            let defaults = bindings::corral::cache::policy::defaults();
            let settings = bindings::corral::cache::types::Settings {
                l1_ttl_ms: L1_TTL_MS,
                ..defaults
            };
            cache::configure(settings, "corral-example:")
        })
        .clone()
}

/// A response: its status, body, and the `x-corral` headers.
struct Reply {
    status: u16,
    body: Vec<u8>,
    headers: Vec<(String, Vec<u8>)>,
}

impl Reply {
    fn text(status: u16, text: impl Into<String>) -> Reply {
        Reply {
            status,
            body: text.into().into_bytes(),
            headers: Vec::new(),
        }
    }
}

impl incoming_handler::Guest for App {
    fn handle(request: IncomingRequest, out: ResponseOutparam) {
        if let Err(e) = configure() {
            return respond(out, error_reply(&e));
        }
        let target = request.path_with_query().unwrap_or_default();
        // The query is not part of the item: `/items/a?x` is item `a`.
        let path = target.split('?').next().unwrap_or_default();
        let id = path.strip_prefix("/items/").filter(|id| is_id(id));
        let reply = match (request.method(), id) {
            (Method::Get, Some(id)) => get_item(id),
            (Method::Put, Some(id)) => match read_body(request.consume().ok()) {
                Ok(value) => put_item(id, value),
                Err(e) => Reply::text(400, e),
            },
            _ => Reply::text(404, "GET or PUT /items/{id}, an id of letters, digits, - and _\n"),
        };
        respond(out, reply);
    }
}

/// An item id: 1 to 128 letters, digits, `-` or `_` (it goes into the origin's path).
fn is_id(id: &str) -> bool {
    (1..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

fn key_of(id: &str) -> String {
    format!("item:{id}")
}

fn get_item(id: &str) -> Reply {
    let key = key_of(id);
    let (value, how) = match cache::begin(&key, options(), false, &[]) {
        Ok(Begun::Hit(value)) => (Ok(value), "hit"),
        Ok(Begun::Lead(load)) => (end(load, id), "loaded"),
        Ok(Begun::Refresh((value, load))) => {
            // Served as a hit; the refresh's own outcome changes nothing here.
            let _ = end(load, id);
            (Ok(value), "hit")
        }
        Ok(Begun::Wait(follower)) => (follow(&follower, id), "hit"),
        Err(e) => (Err(e), "error"),
    };
    match value {
        Ok(body) => {
            let again = match cache::get(&key) {
                Ok(Some(_)) => "hit",
                _ => "miss",
            };
            Reply {
                status: 200,
                body,
                headers: vec![
                    ("x-corral".to_owned(), how.as_bytes().to_vec()),
                    ("x-corral-again".to_owned(), again.as_bytes().to_vec()),
                ],
            }
        }
        Err(e) => error_reply(&e),
    }
}

/// A load this request leads: the origin's answer ends it.
fn end(load: Load, id: &str) -> Result<Vec<u8>, Error> {
    match origin(id) {
        Ok(value) => Load::complete(load, &value, true),
        Err(reason) => Load::fail(load, &reason),
    }
}

/// Another caller of this instance holds the load: a `wasi:http@0.2` handler runs one
/// request at a time, so that holder cannot end it while this one waits; take its
/// outcome if it is there, else lead in its place once it is dropped.
fn follow(follower: &cache::Follower, id: &str) -> Result<Vec<u8>, Error> {
    match follower.outcome() {
        Followed::Ready(outcome) => outcome,
        Followed::Lead(load) => end(load, id),
        Followed::Pending => Err(Error::Unavailable("another request holds the load".to_owned())),
    }
}

fn put_item(id: &str, value: Vec<u8>) -> Reply {
    match cache::set(&key_of(id), &value, options()) {
        Ok(()) => Reply::text(204, ""),
        Err(e) => error_reply(&e),
    }
}

fn error_reply(e: &Error) -> Reply {
    match e {
        Error::InvalidArgument(a) => Reply::text(400, format!("{}: {}\n", a.name, a.reason)),
        Error::LoaderFailed(text) => Reply::text(502, format!("the origin failed: {text}\n")),
        Error::Timeout(text) => Reply::text(504, format!("{text}\n")),
        Error::Unavailable(text) | Error::Corrupt(text) | Error::Other(text) => {
            Reply::text(503, format!("{text}\n"))
        }
    }
}

/// `GET http://$CORRAL_EXAMPLE_ORIGIN/items/{id}`: the body of a 200, else why not.
fn origin(id: &str) -> Result<Vec<u8>, String> {
    let authority = std::env::var("CORRAL_EXAMPLE_ORIGIN").unwrap_or_else(|_| DEFAULT_ORIGIN.to_owned());
    let request = OutgoingRequest::new(Fields::new());
    let set = request
        .set_method(&Method::Get)
        .and(request.set_scheme(Some(&Scheme::Http)))
        .and(request.set_authority(Some(&authority)))
        .and(request.set_path_with_query(Some(&format!("/items/{id}"))));
    set.map_err(|()| format!("a bad origin address: {authority}"))?;
    let body = request
        .body()
        .map_err(|()| "the request body was taken".to_owned())?;
    let pending = outgoing_handler::handle(request, None).map_err(|e| format!("{e:?}"))?;
    OutgoingBody::finish(body, None).map_err(|e| format!("{e:?}"))?;
    pending.subscribe().block();
    let response = match pending.get() {
        Some(Ok(Ok(response))) => response,
        Some(Ok(Err(e))) => return Err(format!("{e:?}")),
        Some(Err(())) | None => return Err("the origin's response was lost".to_owned()),
    };
    let status = response.status();
    let value = read_body(response.consume().ok())?;
    if status != 200 {
        return Err(format!("the origin answered {status}"));
    }
    Ok(value)
}

/// The whole of a body.
fn read_body(body: Option<IncomingBody>) -> Result<Vec<u8>, String> {
    let body = body.ok_or("the body was taken")?;
    let stream = body.stream().map_err(|()| "the body's stream was taken")?;
    let mut out = Vec::new();
    loop {
        match stream.blocking_read(64 * 1024) {
            Ok(chunk) => out.extend_from_slice(&chunk),
            Err(StreamError::Closed) => break,
            Err(StreamError::LastOperationFailed(e)) => return Err(e.to_debug_string()),
        }
    }
    drop(stream);
    let _ = IncomingBody::finish(body);
    Ok(out)
}

fn respond(out: ResponseOutparam, reply: Reply) {
    let mut headers = vec![("content-type".to_owned(), b"text/plain".to_vec())];
    headers.extend(reply.headers);
    // An error outparam ends some hosts' servers (jco's exits): always a response.
    let fields = Fields::from_list(&headers).unwrap_or_else(|_| Fields::new());
    let response = OutgoingResponse::new(fields);
    let _ = response.set_status_code(reply.status);
    let body = response.body();
    ResponseOutparam::set(out, Ok(response));
    let Ok(body) = body else { return };
    if let Ok(stream) = body.write() {
        // `blocking-write-and-flush` takes at most 4096 bytes a call.
        for chunk in reply.body.chunks(4096) {
            if stream.blocking_write_and_flush(chunk).is_err() {
                break;
            }
        }
        drop(stream);
    }
    let _ = OutgoingBody::finish(body, None);
}
