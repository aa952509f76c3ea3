//! The one way a case waits: poll until a probe yields a value or the deadline passes.

use std::thread::sleep;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

/// How often a probe is retried, as the bash suites' `wait_until` did.
const POLL: Duration = Duration::from_millis(500);

/// Polls `probe` until it yields `Some`, at least once. A probe's error ends the wait at once:
/// a transient state (a kubelet restarting, a pod not listed yet) is `Ok(None)`, not an error.
/// On timeout the error says what was awaited and for how long; the caller adds what it saw.
pub fn wait_for<T>(
    what: &str,
    deadline: Duration,
    mut probe: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let end = Instant::now() + deadline;
    loop {
        if let Some(value) = probe()? {
            return Ok(value);
        }
        if Instant::now() >= end {
            bail!("{what}: not within {}s", deadline.as_secs());
        }
        sleep(POLL);
    }
}

/// [`wait_for`] for a condition.
pub fn wait_until(what: &str, deadline: Duration, mut holds: impl FnMut() -> bool) -> Result<()> {
    wait_for(what, deadline, || Ok(holds().then_some(())))
}

pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn yields_the_first_value_the_probe_gives() {
        let mut calls = 0;
        let got = wait_for("third call", secs(5), || {
            calls += 1;
            Ok((calls == 3).then_some(calls))
        })
        .unwrap();
        assert_eq!(got, 3);
    }

    #[test]
    fn times_out_naming_what_it_waited_for() {
        let err = wait_until("never", Duration::ZERO, || false).unwrap_err();
        assert_eq!(err.to_string(), "never: not within 0s");
    }

    #[test]
    fn a_probe_error_ends_the_wait() {
        let err = wait_for::<()>("broken", secs(60), || bail!("no such file")).unwrap_err();
        assert_eq!(err.to_string(), "no such file");
    }
}
