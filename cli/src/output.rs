//! Where the CLI's words go. Results go to stdout through [`out!`], which reports a
//! closed stdout (`corral demo | head -1`) as a quiet [`Failure`] instead of a panic.
//! Everything for a person (errors, warnings, progress, logs, panics) goes to stderr
//! through [`say!`] or the log writer, redacted ([`crate::redact`]) and never failing.

use std::fmt;
use std::io::{self, IsTerminal, Write};

use crate::failure::Failure;

/// Prints a line on stdout: `out!("{x}")?`. A closed stdout ends the command quietly.
macro_rules! out {
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}

/// Prints a line on stderr, redacted. A closed stderr is ignored: there is no one to tell.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::output::say_line(format_args!($($arg)*))
    };
}

pub(crate) use {out, say};

/// Writes one line on stdout.
pub fn line(args: fmt::Arguments<'_>) -> Result<(), Failure> {
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "{args}")
        .and_then(|()| stdout.flush())
        .map_err(Failure::from_stdout)
}

/// Writes a value's bytes on stdout exactly as stored (a value is a byte string). A
/// terminal gets them readable instead ([`for_terminal`]) and a newline after them,
/// which its prompt would otherwise follow.
pub fn value(bytes: &[u8]) -> Result<(), Failure> {
    if io::stdout().is_terminal() {
        write_out(&[for_terminal(bytes).as_bytes(), b"\n"])
    } else {
        write_out(&[bytes])
    }
}

/// Writes a value's bytes on stdout exactly, then a newline: one line of a script's
/// output.
pub fn value_line(bytes: &[u8]) -> Result<(), Failure> {
    write_out(&[bytes, b"\n"])
}

/// Writes `parts` on stdout, in order, and flushes it.
fn write_out(parts: &[&[u8]]) -> Result<(), Failure> {
    let mut stdout = io::stdout().lock();
    parts
        .iter()
        .try_for_each(|part| stdout.write_all(part))
        .and_then(|()| stdout.flush())
        .map_err(Failure::from_stdout)
}

/// `bytes` as a terminal may show them: UTF-8 text as it is, but control characters
/// (other than newline and tab) and bytes that are not UTF-8 escaped (`\u{1b}`,
/// `\xff`), so that a value from a shared cache cannot move the cursor, retitle the
/// window or write the clipboard.
fn for_terminal(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut shown = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for c in chunk.valid().chars() {
            if c.is_control() && c != '\n' && c != '\t' {
                shown.extend(c.escape_default());
            } else {
                shown.push(c);
            }
        }
        for b in chunk.invalid() {
            // Writing to a String cannot fail.
            let _ = write!(shown, "\\x{b:02x}");
        }
    }
    shown
}

/// Writes one redacted line on stderr, ignoring errors.
pub fn say_line(args: fmt::Arguments<'_>) {
    let text = args.to_string();
    let _ = writeln!(io::stderr().lock(), "{}", crate::redact::redact(&text));
}

/// Sends the log (`CORRAL_LOG`, e.g. `debug` or `corral=trace`; default `warn`) to
/// stderr, redacted, and makes a panic a redacted one-line report.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("CORRAL_LOG").unwrap_or_else(|_| "warn".into());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(io::stderr().is_terminal())
        .with_writer(|| RedactedStderr)
        .init();
    std::panic::set_hook(Box::new(|info| {
        say!("corral: internal error, please report it with the command you ran: {info}");
    }));
}

/// stderr, with every write redacted. The log formats a whole event before writing
/// it, so a secret never straddles two writes.
struct RedactedStderr;

impl Write for RedactedStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        let _ = io::stderr()
            .lock()
            .write_all(crate::redact::redact(&text).as_bytes());
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        io::stderr().flush()
    }
}

#[cfg(test)]
mod tests {
    use super::for_terminal;

    #[test]
    fn a_terminal_sees_control_characters_and_bytes_that_are_not_utf8_escaped() {
        assert_eq!(for_terminal("été\tok\n".as_bytes()), "été\tok\n");
        assert_eq!(for_terminal(b"\x1b]52;c;aGk=\x07"), "\\u{1b}]52;c;aGk=\\u{7}");
        assert_eq!(for_terminal(b"\xff\x00\xfe"), "\\xff\\u{0}\\xfe");
    }
}
