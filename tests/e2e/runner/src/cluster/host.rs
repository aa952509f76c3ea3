//! The cluster's infrastructure stays with the suite's bash (tests/e2e/cluster.sh), which keeps
//! its daemons, nodes and their mount namespaces in its own state. A case asks it for what it
//! needs through two FIFOs: one request per line (`VERB ARG...`), one reply per line (`STATUS
//! TEXT`, where TEXT is the request's output or, on failure, its reason).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use anyhow::{Context, Result, bail, ensure};

pub struct Host {
    requests: File,
    replies: BufReader<File>,
}

impl Host {
    /// Opens both FIFOs; the suite holds each open for reading and writing, so neither open
    /// waits.
    pub fn open(requests: &Path, replies: &Path) -> Result<Host> {
        let requests = OpenOptions::new()
            .write(true)
            .open(requests)
            .with_context(|| format!("open {}", requests.display()))?;
        let replies = File::open(replies).with_context(|| format!("open {}", replies.display()))?;
        Ok(Host {
            requests,
            replies: BufReader::new(replies),
        })
    }

    /// What the suite printed for `verb args...`, or its reason as the error. The suite runs one
    /// request at a time and always replies.
    pub fn request(&mut self, verb: &str, args: &[&str]) -> Result<String> {
        ensure!(
            args.iter()
                .all(|arg| !arg.is_empty() && !arg.contains(char::is_whitespace)),
            "a host request's arguments are words: {args:?}"
        );
        let request = std::iter::once(verb)
            .chain(args.iter().copied())
            .collect::<Vec<_>>()
            .join(" ");
        // One write of a short line: a FIFO keeps it whole.
        self.requests
            .write_all(format!("{request}\n").as_bytes())
            .with_context(|| format!("ask the suite for `{request}`"))?;
        let mut reply = String::new();
        self.replies
            .read_line(&mut reply)
            .with_context(|| format!("read the suite's reply to `{request}`"))?;
        let reply = reply.trim_end();
        let (status, text) = reply.split_once(' ').unwrap_or((reply, ""));
        match status {
            "0" => Ok(text.to_owned()),
            "" => bail!("`{request}`: the suite closed the channel"),
            status => bail!("`{request}` failed (status {status}): {text}"),
        }
    }
}
