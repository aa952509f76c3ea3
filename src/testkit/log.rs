//! What code under test logs, captured as text, for tests that check a warning is given once.

use std::io;
use std::sync::{Arc, Mutex};

/// What the code under test logs, as text.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<Vec<u8>>>);

impl io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Log {
    /// Captures what this thread logs until the guard is dropped.
    pub fn capture(&self) -> tracing::subscriber::DefaultGuard {
        let log = self.clone();
        tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(move || log.clone())
                .with_ansi(false)
                .finish(),
        )
    }

    pub fn warnings(&self) -> Vec<String> {
        String::from_utf8(self.0.lock().unwrap().clone())
            .unwrap()
            .lines()
            .filter(|line| line.contains("WARN"))
            .map(str::to_owned)
            .collect()
    }
}
