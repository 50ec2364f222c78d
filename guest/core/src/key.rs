//! What a key may be (contract §2).
//!
//! A key is required: non-empty and not only white space. It is never trimmed, so
//! `"a"` and `" a"` are two keys. A cache MAY limit its length.

use crate::{Arg, ArgError, Limits};

/// Checks `key` against the contract and `limits`.
///
/// # Errors
/// An [`ArgError`] naming `key` when it is empty, only white space, or longer than
/// `limits.max_key_bytes` UTF-8 bytes.
pub fn validate(key: &str, limits: &Limits) -> Result<(), ArgError> {
    if key.is_empty() {
        return Err(ArgError::new(Arg::Key, "must not be empty"));
    }
    if key.chars().all(char::is_whitespace) {
        return Err(ArgError::new(Arg::Key, "must not be only white space"));
    }
    if key.len() > limits.max_key_bytes as usize {
        return Err(ArgError::new(
            Arg::Key,
            format!(
                "is {} bytes, over the limit of {}",
                key.len(),
                limits.max_key_bytes
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(key: &str) -> Result<(), ArgError> {
        validate(key, &Limits::default())
    }

    #[test]
    fn empty_key_is_rejected() {
        let err = check("").unwrap_err();
        assert_eq!(err.arg, Arg::Key);
        assert!(err.reason.contains("empty"), "{err}");
    }

    #[test]
    fn white_space_keys_are_rejected() {
        for key in [" ", "\t", "\n\r ", "\u{a0}", "\u{2003}\u{3000}"] {
            let err = check(key).unwrap_err();
            assert_eq!(err.arg, Arg::Key, "{key:?}");
            assert!(err.reason.contains("white space"), "{err}");
        }
    }

    #[test]
    fn keys_with_surrounding_space_are_kept_as_they_are() {
        assert_eq!(check(" a "), Ok(()));
        assert_eq!(check("a\n"), Ok(()));
    }

    #[test]
    fn any_unicode_is_allowed() {
        assert_eq!(check("ключ:키:anahtar"), Ok(()));
    }

    #[test]
    fn key_length_is_counted_in_bytes_up_to_the_limit() {
        let limits = Limits {
            max_key_bytes: 4,
            ..Limits::default()
        };
        assert_eq!(validate("abcd", &limits), Ok(()));
        // "é" is two bytes: "abé" is 4 bytes, "abéd" 5.
        assert_eq!(validate("abé", &limits), Ok(()));
        let err = validate("abéd", &limits).unwrap_err();
        assert_eq!(err.arg, Arg::Key);
        assert!(err.reason.contains("over the limit of 4"), "{err}");
    }
}
