//! Where a setting's value came from, and the one-line error that names it.

use std::fmt;
use std::path::PathBuf;

/// Where a setting's value came from, to name it in an error: in one found while parsing, and
/// in one found later, once the node is scanned or a port bound. A default is named by its
/// flag, the way to change it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Flag(&'static str),
    Env(&'static str),
    /// The file and the dotted key in it.
    File(PathBuf, String),
}

impl fmt::Display for Origin {
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
