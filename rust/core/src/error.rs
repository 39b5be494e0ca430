//! The one error type of the core. Every variant names what is wrong and where.

use std::io;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoreError {
    /// An operating-system error while touching `path`.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The directory has no committed manifest.
    #[error("{path}: not an olmo-chunks checkpoint: {reason}")]
    NotACheckpoint { path: PathBuf, reason: String },
    /// The manifest cannot be decoded or contradicts itself.
    #[error("{path}: corrupt manifest: {reason}")]
    CorruptManifest { path: PathBuf, reason: String },
    /// The manifest was written by a newer (or unknown) format version.
    #[error("{path}: checkpoint format version {found} is not supported by this reader (supports 1 to {supported}); upgrade olmo-chunks to read it")]
    UnsupportedVersion {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    /// Data bytes do not match their recorded checksum.
    #[error("{path}: checksum mismatch in tensor {key:?} chunk {chunk} (file bytes {start}..{end}): expected crc32c {expected:08x}, found {found:08x}")]
    ChecksumMismatch {
        path: PathBuf,
        key: String,
        chunk: usize,
        start: u64,
        end: u64,
        expected: u32,
        found: u32,
    },
    /// A compressed block whose checksum matches but that does not decode to its raw bytes (not a
    /// zstd frame, or one of the wrong length).
    #[error("{path}: tensor {key:?} chunk {chunk} (file bytes {start}..{end}): {reason}")]
    CorruptData {
        path: PathBuf,
        key: String,
        chunk: usize,
        start: u64,
        end: u64,
        reason: String,
    },
    /// A data file is shorter than the manifest says.
    #[error("{path}: data file is truncated: tensor {key:?} chunk {chunk} needs bytes up to {needed}, file has {size}")]
    Truncated {
        path: PathBuf,
        key: String,
        chunk: usize,
        needed: u64,
        size: u64,
    },
    /// A file the manifest names is refused before it is read: a symbolic link lies on its path
    /// below the checkpoint directory, or it is not a regular file (a FIFO, device or socket).
    #[error("{path}: refused: {reason}")]
    UnsafePath { path: PathBuf, reason: String },
    /// Chunks out of bounds, overlapping, or not tiling their tensor.
    #[error("tensor {key:?}: {reason}")]
    Layout { key: String, reason: String },
    /// A checkpoint is already committed at the path and the save did not ask to overwrite it.
    #[error("{path}: Checkpoint already exists (committed there by an earlier save); pass overwrite=True (the CLI's --overwrite) to replace it (nothing was changed)")]
    Exists { path: PathBuf },
    /// Another save holds the directory's lease, or took this save's over.
    #[error("{path}: {reason}")]
    Locked { path: PathBuf, reason: String },
    /// A caller passed something inconsistent (e.g. a destination too small for its region).
    #[error("{0}")]
    InvalidArgument(String),
}

pub type Result<T> = std::result::Result<T, CoreError>;

/// Whether `e` is this process's own shortage (of file descriptors, memory or threads), which
/// waiting does not mend: a store connection that fails so is not the store's host gone, and a
/// file that cannot be opened so is not missing.
pub fn is_own_shortage(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::OutOfMemory
        || matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::ENOBUFS)
        )
}

/// `e` of a thread that could not be started, saying so: an own shortage ([`is_own_shortage`]).
pub fn no_thread(e: io::Error) -> io::Error {
    let why = format!(
        "could not start a thread ({e}): the process is at a limit on threads or memory (ulimit \
         -u, a container's pids.max, ulimit -v)"
    );
    io::Error::new(io::ErrorKind::OutOfMemory, why)
}

impl CoreError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        CoreError::Io {
            path: path.into(),
            source,
        }
    }
    /// The error for a thread that could not be started (a limit on threads or memory).
    pub fn no_thread(e: io::Error) -> Self {
        CoreError::io("olmo-chunks", no_thread(e))
    }
    pub(crate) fn layout(key: &str, reason: impl Into<String>) -> Self {
        CoreError::Layout {
            key: key.to_string(),
            reason: reason.into(),
        }
    }
}

/// An error's text as the user sees it: the password of every URL in it hidden (an endpoint given
/// as `http://user:secret@host` is in the URL of every request) and control characters escaped
/// (`\u{1b}`: what a file of the checkpoint says, a lease's holder, cannot rewrite the terminal
/// or forge log lines).
pub fn shown(text: &str) -> String {
    hide_passwords(text)
        .chars()
        .map(|c| {
            if c.is_control() {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `text` with the password of every URL in it (`scheme://user:password@host`) replaced by
/// `***`, and a userinfo without one (a token as the user name) too.
fn hide_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (head, tail) = rest.split_at(at + 3);
        out.push_str(head);
        let end = tail
            .find(|c: char| c == '/' || c == '"' || c.is_whitespace())
            .unwrap_or(tail.len());
        match tail[..end].rfind('@') {
            Some(userinfo_end) => {
                let userinfo = &tail[..userinfo_end];
                match userinfo.split_once(':') {
                    Some((user, _)) => out.push_str(&format!("{user}:***")),
                    None => out.push_str("***"),
                }
                rest = &tail[userinfo_end..];
            }
            None => rest = tail,
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_text_hides_passwords_and_escapes_control_characters() {
        let text = "GET http://user:s3cr@t@host:9/b/k failed; \"https://tok@h/x\" and s3://b/k, ftp://a:b@c";
        assert_eq!(
            hide_passwords(text),
            "GET http://user:***@host:9/b/k failed; \"https://***@h/x\" and s3://b/k, ftp://a:***@c"
        );
        assert_eq!(hide_passwords("no url"), "no url");
        assert_eq!(hide_passwords("x://"), "x://");
        assert_eq!(
            shown("held by h\x1b[2J\r\nfake, http://u:p@h/"),
            "held by h\\u{1b}[2J\\u{d}\\u{a}fake, http://u:***@h/"
        );
    }
}
