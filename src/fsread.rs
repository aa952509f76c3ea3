//! Reads of small files that a FIFO, a device node or a huge file cannot turn into a hang or a
//! large allocation: sysfs attributes and the config file.
//!
//! The file is opened non-blocking, so opening a FIFO returns at once instead of waiting for a
//! writer, and then checked with `fstat`: only a regular file is read, and at most `limit`
//! bytes of it. A read that blocks inside a driver is not prevented here; callers run these
//! reads off the async runtime and give them a deadline.

use std::fs::{File, FileType, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use nix::fcntl::OFlag;

/// A sysfs attribute is at most a page; a few KiB leaves room without reading a huge file.
pub(crate) const ATTRIBUTE_LIMIT: u64 = 4096;

/// Opens `path` for reading without blocking on a FIFO and without becoming its controlling
/// terminal; fails unless it is a regular file.
pub(crate) fn open_regular(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags((OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC).bits())
        .open(path)?;
    check_regular(&file)?;
    Ok(file)
}

/// Fails unless `file` is a regular file, naming what it is instead.
pub(crate) fn check_regular(file: &File) -> io::Result<()> {
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file but {}", describe(kind)),
    ))
}

/// What a file type is, in the words an operator would use.
pub(crate) fn describe(kind: FileType) -> &'static str {
    if kind.is_dir() {
        "a directory"
    } else if kind.is_symlink() {
        "a symbolic link"
    } else if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_char_device() {
        "a character device"
    } else if kind.is_block_device() {
        "a block device"
    } else if kind.is_file() {
        "a regular file"
    } else {
        "an unknown kind of file"
    }
}

/// The text of the regular file at `path`, refused when longer than `limit` bytes.
pub(crate) fn read_text(path: &Path, limit: u64) -> io::Result<String> {
    let mut text = String::new();
    open_regular(path)?
        .take(limit + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {limit} bytes"),
        ));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_regular_files_within_the_limit_are_read() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("small");
        std::fs::write(&small, "231:192\n").unwrap();
        assert_eq!(read_text(&small, ATTRIBUTE_LIMIT).unwrap(), "231:192\n");

        // Read whole, this would be a 100 MiB allocation; only limit + 1 bytes are read.
        let huge = dir.path().join("huge");
        File::create(&huge).unwrap().set_len(100 << 20).unwrap();
        let err = read_text(&huge, ATTRIBUTE_LIMIT).unwrap_err();
        assert!(err.to_string().contains("larger than 4096 bytes"), "{err}");

        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRUSR).unwrap();
        let err = read_text(&fifo, ATTRIBUTE_LIMIT).unwrap_err();
        assert!(err.to_string().contains("a FIFO"), "{err}");

        let err = read_text(dir.path(), ATTRIBUTE_LIMIT).unwrap_err();
        assert!(err.to_string().contains("a directory"), "{err}");
    }
}
