//! The `corral` binary as a person, a shell script or cron uses it: what it prints, how
//! it exits, what it does to the command it runs, and what it never prints.

mod commands;
mod lock;
mod secrets;
mod support;
