//! Subject-safe tokens.
//!
//! Task ids, pools and workspace topics become tokens of NATS subjects
//! (`flotilla.task.<pool>.<run>.<task>`), so they must not contain the token separator `.`,
//! the wildcards `*` and `>`, whitespace or control characters. Pools additionally name
//! JetStream consumers, and agent names are config keys, so both are held to a narrower
//! ASCII alphabet.

/// Longest task id or topic, in bytes.
pub const MAX_TOKEN_LEN: usize = 128;
/// Longest pool or agent name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Why a string is not a valid subject token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// The token is empty.
    #[error("is empty")]
    Empty,
    /// The token is longer than allowed.
    #[error("is longer than {max} bytes")]
    TooLong {
        /// The limit that was exceeded.
        max: usize,
    },
    /// The token contains a character NATS treats specially.
    #[error("contains {0:?}, which is not allowed in a subject token")]
    Forbidden(char),
    /// The token contains whitespace.
    #[error("contains whitespace")]
    Whitespace,
    /// The token contains a control character.
    #[error("contains a control character")]
    Control,
    /// A name contains a character outside `A-Z a-z 0-9 _ -`.
    #[error("contains {0:?}; names may only use letters, digits, `_` and `-`")]
    NotAName(char),
}

/// Checks that `s` can be used as one token of a NATS subject.
pub fn check_token(s: &str) -> Result<(), TokenError> {
    if s.is_empty() {
        return Err(TokenError::Empty);
    }
    if s.len() > MAX_TOKEN_LEN {
        return Err(TokenError::TooLong { max: MAX_TOKEN_LEN });
    }
    for c in s.chars() {
        match c {
            '.' | '*' | '>' => return Err(TokenError::Forbidden(c)),
            c if c.is_whitespace() => return Err(TokenError::Whitespace),
            c if c.is_control() => return Err(TokenError::Control),
            _ => {}
        }
    }
    Ok(())
}

/// Longest subject accepted where a client names one (`reply_to`).
pub const MAX_SUBJECT_LEN: usize = 512;

/// Why a string is not a subject a message can be published to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubjectError {
    /// The subject is empty.
    #[error("is empty")]
    Empty,
    /// The subject is too long.
    #[error("is longer than {MAX_SUBJECT_LEN} bytes")]
    TooLong,
    /// A token (between dots) is empty: leading, trailing or doubled `.`.
    #[error("has an empty token (a leading, trailing or doubled `.`)")]
    EmptyToken,
    /// A token is not valid.
    #[error("has an invalid token {token:?}: {reason}")]
    BadToken {
        /// The token.
        token: String,
        /// Why.
        reason: TokenError,
    },
}

/// Checks that `s` is a subject a message can be published to: non-empty `.`-separated
/// tokens without wildcards, whitespace or control characters.
pub fn check_subject(s: &str) -> Result<(), SubjectError> {
    if s.is_empty() {
        return Err(SubjectError::Empty);
    }
    if s.len() > MAX_SUBJECT_LEN {
        return Err(SubjectError::TooLong);
    }
    for token in s.split('.') {
        if token.is_empty() {
            return Err(SubjectError::EmptyToken);
        }
        for c in token.chars() {
            let reason = match c {
                '*' | '>' => TokenError::Forbidden(c),
                c if c.is_whitespace() => TokenError::Whitespace,
                c if c.is_control() => TokenError::Control,
                _ => continue,
            };
            return Err(SubjectError::BadToken {
                token: token.to_owned(),
                reason,
            });
        }
    }
    Ok(())
}

/// Checks a pool, agent or prefix name: ASCII letters, digits, `_` and `-`.
pub fn check_name(s: &str) -> Result<(), TokenError> {
    if s.is_empty() {
        return Err(TokenError::Empty);
    }
    if s.len() > MAX_NAME_LEN {
        return Err(TokenError::TooLong { max: MAX_NAME_LEN });
    }
    match s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || *c == '_' || *c == '-'))
    {
        Some(c) => Err(TokenError::NotAName(c)),
        None => Ok(()),
    }
}

/// Normalises a workspace topic the way the source material does: trim, lowercase,
/// and turn inner runs of spaces into `_`. The result still has to pass [`check_token`].
pub fn normalize_topic(topic: &str) -> String {
    let mut out = String::with_capacity(topic.len());
    let mut pending_space = false;
    for c in topic.trim().chars() {
        if c == ' ' {
            pending_space = true;
            continue;
        }
        if pending_space {
            out.push('_');
            pending_space = false;
        }
        out.extend(c.to_lowercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subjects() {
        assert!(check_subject("my.app.outcomes").is_ok());
        assert!(check_subject("_INBOX.abc123").is_ok());
        assert_eq!(check_subject(""), Err(SubjectError::Empty));
        assert_eq!(check_subject("a..b"), Err(SubjectError::EmptyToken));
        assert_eq!(check_subject(".a"), Err(SubjectError::EmptyToken));
        assert!(matches!(
            check_subject("out b *"),
            Err(SubjectError::BadToken {
                reason: TokenError::Whitespace,
                ..
            })
        ));
        assert!(matches!(
            check_subject("out.*"),
            Err(SubjectError::BadToken {
                reason: TokenError::Forbidden('*'),
                ..
            })
        ));
        assert!(check_subject(&"a".repeat(MAX_SUBJECT_LEN + 1)).is_err());
    }

    #[test]
    fn tokens() {
        assert!(check_token("fetch_data").is_ok());
        assert!(check_token("売上").is_ok());
        assert_eq!(check_token(""), Err(TokenError::Empty));
        assert_eq!(check_token("a.b"), Err(TokenError::Forbidden('.')));
        assert_eq!(check_token("a*"), Err(TokenError::Forbidden('*')));
        assert_eq!(check_token(">"), Err(TokenError::Forbidden('>')));
        assert_eq!(check_token("a b"), Err(TokenError::Whitespace));
        assert_eq!(check_token("a\tb"), Err(TokenError::Whitespace));
        assert_eq!(check_token("a\u{7}"), Err(TokenError::Control));
        assert!(matches!(
            check_token(&"x".repeat(MAX_TOKEN_LEN + 1)),
            Err(TokenError::TooLong { .. })
        ));
    }

    #[test]
    fn names() {
        assert!(check_name("gpu-pool_2").is_ok());
        assert_eq!(check_name("a/b"), Err(TokenError::NotAName('/')));
        assert_eq!(check_name(""), Err(TokenError::Empty));
    }

    #[test]
    fn topic_normalisation() {
        assert_eq!(normalize_topic("  Raw Data  "), "raw_data");
        assert_eq!(normalize_topic("Q3   Figures"), "q3_figures");
        assert_eq!(normalize_topic("growth"), "growth");
    }
}
