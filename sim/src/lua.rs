//! Redis's scripting, as the simulated store runs it: the guest's Lua text (the very
//! strings `corral-core`'s `script` module hands every body) executed by Lua 5.1, the
//! version Redis embeds, with `redis.call` and `redis.pcall` answered by a [`Keyspace`]:
//! the simulated server's commands over the world's keys. A script is one atomic step,
//! as on Redis: nothing else touches the keyspace while it runs.
//!
//! Values cross between Lua and the keyspace by Redis's conversion rules: an integer
//! reply is a Lua number, a bulk reply a string, a nil reply `false`, a status reply a
//! table with an `ok` field and an error reply (from `pcall`) one with `err`; a Lua
//! number returned becomes an integer (truncated), a string a bulk reply, `false` or
//! `nil` a nil reply, `true` the integer 1, an `{err = ...}` table an error reply.

use std::cell::RefCell;
use std::collections::HashMap;

use mlua::{Function, Lua, LuaOptions, MultiValue, StdLib, Table, Value};

/// A reply as a Redis server sends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Reply {
    Nil,
    Int(i64),
    Bulk(Vec<u8>),
    Status(String),
    Error(String),
    Array(Vec<Reply>),
}

impl Reply {
    pub(crate) fn ok() -> Reply {
        Reply::Status("OK".to_owned())
    }

    pub(crate) fn error(text: impl Into<String>) -> Reply {
        Reply::Error(text.into())
    }
}

/// The commands a script may send, over the server's keys. `args[0]` is the command's
/// name, in any case.
pub(crate) trait Keyspace {
    fn command(&mut self, args: &[Vec<u8>]) -> Reply;
}

thread_local! {
    /// One Lua per thread (a seed's world runs on one thread), and each script's text
    /// compiled once, as Redis keeps `SCRIPT LOAD`ed scripts.
    static LUA: (Lua, RefCell<HashMap<String, Function>>) = (redis_lua(), RefCell::new(HashMap::new()));
}

/// A Lua as Redis sets one up: the base, table, string and math libraries only (no `os`,
/// `io` or `package`), and globals protected, so a script that assigns or reads an
/// undeclared global (a `local` forgotten) fails here as it fails on Redis, and leaves
/// nothing behind for the next seed.
fn redis_lua() -> Lua {
    let lua = Lua::new_with(
        StdLib::TABLE | StdLib::STRING | StdLib::MATH,
        LuaOptions::default(),
    )
    .expect("a Lua 5.1 state");
    let redis = lua.create_table().expect("the redis table");
    for (name, field) in [("error_reply", "err"), ("status_reply", "ok")] {
        let reply = lua
            .create_function(move |lua, text: mlua::LuaString| one_field(lua, field, text))
            .expect("a reply builder");
        redis.raw_set(name, reply).expect("the redis table");
    }
    lua.globals().raw_set("redis", redis).expect("the redis table");
    lua.load(
        r#"
setmetatable(_G, {
  __newindex = function(_, name)
    error("Script attempted to create global variable '" .. tostring(name) .. "'", 2)
  end,
  __index = function(_, name)
    error("Script attempted to access nonexistent global variable '" .. tostring(name) .. "'", 2)
  end,
})
"#,
    )
    .exec()
    .expect("protected globals");
    lua
}

/// Runs `script` with `KEYS` and `ARGV` over `keyspace`, as `EVAL` does: its reply, or
/// an error reply for a script that raised one (its own `error_reply`, a failed
/// `redis.call`, or a Lua runtime error).
pub(crate) fn eval(script: &str, keys: &[&str], argv: &[&[u8]], keyspace: &mut dyn Keyspace) -> Reply {
    LUA.with(|(lua, compiled)| {
        run(lua, compiled, script, keys, argv, keyspace).unwrap_or_else(|e| Reply::Error(script_error(&e)))
    })
}

fn run(
    lua: &Lua,
    compiled: &RefCell<HashMap<String, Function>>,
    script: &str,
    keys: &[&str],
    argv: &[&[u8]],
    keyspace: &mut dyn Keyspace,
) -> mlua::Result<Reply> {
    let function = {
        let mut compiled = compiled.borrow_mut();
        match compiled.get(script) {
            Some(f) => f.clone(),
            None => {
                let f = lua.load(script).set_name("script").into_function()?;
                compiled.insert(script.to_owned(), f.clone());
                f
            }
        }
    };
    let globals = lua.globals();
    // Set past the protection, as Redis sets them.
    globals.raw_set("KEYS", lua.create_sequence_from(keys.iter().copied())?)?;
    let args = argv
        .iter()
        .map(|a| lua.create_string(a))
        .collect::<mlua::Result<Vec<_>>>()?;
    globals.raw_set("ARGV", lua.create_sequence_from(args)?)?;
    let keyspace = RefCell::new(keyspace);
    let redis: Table = globals.raw_get("redis")?;
    lua.scope(|scope| {
        let send = |args: MultiValue| -> mlua::Result<Reply> {
            let args = args.iter().map(argument).collect::<mlua::Result<Vec<_>>>()?;
            if args.is_empty() {
                return Err(mlua::Error::runtime(
                    "Please specify at least one argument for redis.call()",
                ));
            }
            Ok(keyspace.borrow_mut().command(&args))
        };
        // Only these two reach the keyspace: they live for this script's run.
        redis.raw_set(
            "call",
            scope.create_function(move |lua, args: MultiValue| match send(args)? {
                Reply::Error(e) => Err(mlua::Error::runtime(e)),
                reply => to_lua(lua, reply),
            })?,
        )?;
        redis.raw_set(
            "pcall",
            scope.create_function(move |lua, args: MultiValue| to_lua(lua, send(args)?))?,
        )?;
        let out: Value = function.call(())?;
        from_lua(&out)
    })
}

/// The text of a script's failure, as an error reply carries it.
fn script_error(e: &mlua::Error) -> String {
    match e {
        mlua::Error::RuntimeError(text) => text.clone(),
        mlua::Error::CallbackError { cause, .. } => script_error(cause),
        other => other.to_string(),
    }
}

/// One argument of `redis.call`: a string as it is, a number as Redis formats it.
fn argument(v: &Value) -> mlua::Result<Vec<u8>> {
    match v {
        Value::String(s) => Ok(s.as_bytes().to_vec()),
        Value::Integer(i) => Ok(i.to_string().into_bytes()),
        Value::Number(n) if n.fract() == 0.0 && n.abs() < 1e17 => Ok((*n as i64).to_string().into_bytes()),
        Value::Number(n) => Ok(n.to_string().into_bytes()),
        _ => Err(mlua::Error::runtime(
            "Lua redis() command arguments must be strings or integers",
        )),
    }
}

fn to_lua(lua: &Lua, reply: Reply) -> mlua::Result<Value> {
    Ok(match reply {
        Reply::Nil => Value::Boolean(false),
        Reply::Int(i) => Value::Number(i as f64),
        Reply::Bulk(b) => Value::String(lua.create_string(b)?),
        Reply::Status(s) => Value::Table(one_field(lua, "ok", s)?),
        Reply::Error(e) => Value::Table(one_field(lua, "err", e)?),
        Reply::Array(items) => {
            let t = lua.create_table()?;
            for (i, item) in items.into_iter().enumerate() {
                t.set(i + 1, to_lua(lua, item)?)?;
            }
            Value::Table(t)
        }
    })
}

/// `{ [field] = value }`: how Lua holds a status (`ok`) or an error (`err`) reply.
fn one_field(lua: &Lua, field: &str, value: impl mlua::IntoLua) -> mlua::Result<Table> {
    let t = lua.create_table()?;
    t.set(field, value)?;
    Ok(t)
}

fn from_lua(v: &Value) -> mlua::Result<Reply> {
    Ok(match v {
        Value::Nil | Value::Boolean(false) => Reply::Nil,
        Value::Boolean(true) => Reply::Int(1),
        Value::Integer(i) => Reply::Int(*i),
        Value::Number(n) => Reply::Int(*n as i64),
        Value::String(s) => Reply::Bulk(s.as_bytes().to_vec()),
        Value::Table(t) => table_reply(t)?,
        _ => Reply::Nil,
    })
}

fn table_reply(t: &Table) -> mlua::Result<Reply> {
    if let Value::String(e) = t.raw_get::<Value>("err")? {
        return Ok(Reply::Error(e.to_string_lossy()));
    }
    if let Value::String(s) = t.raw_get::<Value>("ok")? {
        return Ok(Reply::Status(s.to_string_lossy()));
    }
    let mut items = Vec::new();
    for i in 1.. {
        match t.raw_get::<Value>(i)? {
            Value::Nil => break,
            v => items.push(from_lua(&v)?),
        }
    }
    Ok(Reply::Array(items))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A keyspace of plain strings: enough to run the scripts' shapes.
    #[derive(Default)]
    struct Plain(HashMap<Vec<u8>, Vec<u8>>);

    impl Keyspace for Plain {
        fn command(&mut self, args: &[Vec<u8>]) -> Reply {
            match args[0].to_ascii_uppercase().as_slice() {
                b"GET" => self.0.get(&args[1]).cloned().map_or(Reply::Nil, Reply::Bulk),
                b"SET" => {
                    if args.iter().any(|a| a.eq_ignore_ascii_case(b"NX")) && self.0.contains_key(&args[1]) {
                        return Reply::Nil;
                    }
                    self.0.insert(args[1].clone(), args[2].clone());
                    Reply::ok()
                }
                b"DEL" => Reply::Int(i64::from(self.0.remove(&args[1]).is_some())),
                _ => Reply::error("ERR unknown command"),
            }
        }
    }

    #[test]
    fn the_guest_scripts_run_with_redis_conversions() {
        let mut ks = Plain::default();
        ks.0.insert(b"k".to_vec(), b"owner".to_vec());
        let script = corral_core::script::DELETE_IF_EQUAL;
        assert_eq!(eval(script, &["k"], &[b"other"], &mut ks), Reply::Int(0));
        assert_eq!(eval(script, &["k"], &[b"owner"], &mut ks), Reply::Int(1));
        assert!(ks.0.is_empty());
        // A failed redis.call aborts the script with its error; pcall hands it back.
        let failing = "redis.call('NOPE') return 1";
        assert_eq!(
            eval(failing, &[], &[], &mut ks),
            Reply::Error("ERR unknown command".into())
        );
        let caught = "local r = redis.pcall('NOPE') return r.err";
        assert_eq!(
            eval(caught, &[], &[], &mut ks),
            Reply::Bulk(b"ERR unknown command".to_vec())
        );
        assert_eq!(
            eval("return redis.error_reply('CORRAL_X no')", &[], &[], &mut ks),
            Reply::Error("CORRAL_X no".into())
        );
        assert_eq!(eval("return 12.9", &[], &[], &mut ks), Reply::Int(12));
        // Globals are protected, and `os` is not there, as on Redis.
        for script in ["x = 1 return x", "return undeclared", "return os.time()"] {
            let got = eval(script, &[], &[], &mut ks);
            assert!(
                matches!(&got, Reply::Error(e) if e.contains("global variable")),
                "{script}: {got:?}"
            );
        }
        // An array ends at its first nil; `false` is a nil reply inside it.
        assert_eq!(
            eval("return {1, 'a', false, nil, 2}", &[], &[], &mut ks),
            Reply::Array(vec![Reply::Int(1), Reply::Bulk(b"a".to_vec()), Reply::Nil])
        );
    }
}
