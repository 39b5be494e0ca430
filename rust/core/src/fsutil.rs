//! Opening the files a manifest names without trusting the directory tree they live in.
//!
//! A checkpoint directory may come from anywhere. A data file named by its manifest is opened
//! strictly beneath the checkpoint directory: no component below it may be a symbolic link (so a
//! crafted checkpoint cannot make a load read, or `verify` vouch for, bytes outside it), and the
//! file must be a regular file (a FIFO, device or socket would block or feed endless bytes).
//! The checkpoint directory itself may be reached through symbolic links.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path};

use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::error::{CoreError, Result};

/// Flags of the final open: read-only, and non-blocking so that opening a FIFO does not wait for
/// a writer (the file is refused by type right after; the flag is then cleared).
fn file_flags() -> OFlags {
    OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK
}

/// Opens `dir/rel` for reading. `rel` must be relative with only normal components; no
/// component of it may be a symbolic link, and the file must be a regular file. Uses `openat2`
/// with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, or, where the kernel lacks it (or a seccomp
/// filter refuses it), an `openat` walk with `O_NOFOLLOW` on every component.
pub fn open_beneath(dir: &Path, rel: &str) -> Result<File> {
    open_impl(dir, rel, true)
}

/// [`open_beneath`] without trying `openat2`: the fallback walk alone (exposed for its tests).
#[doc(hidden)]
pub fn open_beneath_walk(dir: &Path, rel: &str) -> Result<File> {
    open_impl(dir, rel, false)
}

fn open_impl(dir: &Path, rel: &str, try_openat2: bool) -> Result<File> {
    let path = dir.join(rel);
    let unsafe_path = |reason: String| CoreError::UnsafePath {
        path: path.clone(),
        reason,
    };
    let parts: Vec<&std::ffi::OsStr> = Path::new(rel)
        .components()
        .map(|c| match c {
            Component::Normal(p) => Ok(p),
            _ => Err(()),
        })
        .collect::<std::result::Result<_, _>>()
        .map_err(|()| unsafe_path("not a relative path inside the checkpoint directory".into()))?;
    if parts.is_empty() {
        return Err(unsafe_path("empty path".into()));
    }
    let io_err = |e: Errno| CoreError::io(&path, e.into());
    let not_regular = |kind: FileType| {
        unsafe_path(format!(
            "not a regular file (a {}); only regular files are read",
            describe(kind)
        ))
    };
    let root = rustix::fs::open(
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| CoreError::io(dir, e.into()))?;
    let opened = if try_openat2 {
        let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS;
        match rustix::fs::openat2(&root, rel, file_flags(), Mode::empty(), resolve) {
            Err(Errno::NOSYS | Errno::PERM) => walk(&root, &parts),
            other => other,
        }
    } else {
        walk(&root, &parts)
    };
    let fd = match opened {
        Ok(fd) => fd,
        // ELOOP: a symlink met under RESOLVE_NO_SYMLINKS / O_NOFOLLOW. EXDEV: an escape from
        // beneath `dir` (cannot happen with normal components, but say so if it does).
        // ENOTDIR: a directory component that is something else, possibly a symlink.
        Err(e @ (Errno::LOOP | Errno::XDEV | Errno::NOTDIR)) => {
            return Err(match symlink_component(&root, &parts) {
                Some(link) => unsafe_path(format!(
                    "{link:?} is a symbolic link; files of a checkpoint are never read through \
                     symbolic links below its directory"
                )),
                None if e == Errno::XDEV => {
                    unsafe_path("resolves outside the checkpoint directory".into())
                }
                None => io_err(e),
            });
        }
        // ENXIO: a socket (which cannot be opened at all); say what it is.
        Err(Errno::NXIO) => {
            return Err(
                match rustix::fs::statat(&root, rel, AtFlags::SYMLINK_NOFOLLOW) {
                    Ok(st) => not_regular(FileType::from_raw_mode(st.st_mode)),
                    Err(_) => io_err(Errno::NXIO),
                },
            )
        }
        Err(e) => return Err(io_err(e)),
    };
    let st = rustix::fs::fstat(&fd).map_err(io_err)?;
    let kind = FileType::from_raw_mode(st.st_mode);
    if kind != FileType::RegularFile {
        return Err(not_regular(kind));
    }
    let flags = rustix::fs::fcntl_getfl(&fd).map_err(io_err)?;
    rustix::fs::fcntl_setfl(&fd, flags - OFlags::NONBLOCK).map_err(io_err)?;
    Ok(File::from(fd))
}

/// Opens `parts` below `root` one component at a time, never following a symbolic link.
fn walk(root: &OwnedFd, parts: &[&std::ffi::OsStr]) -> std::result::Result<OwnedFd, Errno> {
    let (last, dirs) = parts.split_last().expect("at least one component");
    let mut cur: Option<OwnedFd> = None;
    for d in dirs {
        let at = cur.as_ref().map_or(root.as_fd(), |f| f.as_fd());
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        cur = Some(rustix::fs::openat(at, *d, flags, Mode::empty())?);
    }
    let at = cur.as_ref().map_or(root.as_fd(), |f| f.as_fd());
    rustix::fs::openat(at, *last, file_flags() | OFlags::NOFOLLOW, Mode::empty())
}

/// The first prefix of `parts` (below `root`) that is a symbolic link, for error messages.
fn symlink_component(root: &OwnedFd, parts: &[&std::ffi::OsStr]) -> Option<String> {
    let mut prefix = std::path::PathBuf::new();
    for p in parts {
        prefix.push(p);
        match rustix::fs::statat(root, &prefix, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Symlink => {
                return Some(prefix.display().to_string())
            }
            Ok(_) => {}
            Err(_) => return None,
        }
    }
    None
}

fn describe(kind: FileType) -> &'static str {
    match kind {
        FileType::Directory => "directory",
        FileType::Fifo => "FIFO",
        FileType::Socket => "socket",
        FileType::CharacterDevice => "character device",
        FileType::BlockDevice => "block device",
        FileType::Symlink => "symbolic link",
        _ => "special file",
    }
}
