//! Where a setting's value came from, and the one-line error that names it.

use std::fmt;
use std::path::Path;

/// Where a setting's value came from, to name it in an error.
pub(super) enum Origin<'a> {
    Flag(&'a str),
    Env(&'a str),
    File(&'a Path, &'a str),
}

impl fmt::Display for Origin<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag(flag) => write!(f, "--{flag}"),
            Origin::Env(var) => write!(f, "{var}"),
            Origin::File(path, key) => write!(f, "config file {}: {key}", path.display()),
        }
    }
}

/// A configuration problem, already phrased as the one line the user sees.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ConfigError(pub String);
