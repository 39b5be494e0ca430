//! Copying out of a read-only mapping of a local file whose pages are in the page cache: scattered
//! pieces without reading the bytes between them (a rank that needs a quarter of every row of a
//! block), and whole ranges, each byte loaded once with its checksum folded in and stored past
//! the cache (`fused`), where `pread` copies through the kernel and a checksum reads it again.
//!
//! A mapped page whose file was truncated under the mapping raises SIGBUS on access, which would
//! kill the process. While a mapping is in use it is registered here, and a SIGBUS handler
//! (installed on first use, chaining to whatever handler was there before) replaces the rest of a
//! registered mapping from the faulting page on with zero pages and marks it faulted: the copy
//! finishes on zeros and is then reported as a short read (`UnexpectedEof`). A fault outside every
//! registered mapping goes to the previous handler, or kills the process as it would have.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::fused::{self, Copies};

/// Bytes a mapping copies out before it lets go of its pages ([`MappedFile::copy`]).
const HELD: u64 = 64 << 20;

/// Mappings in use at once (one per data file a read has open); a file that finds no slot free
/// is read instead of mapped.
const SLOTS: usize = 1024;

struct Slot {
    busy: AtomicBool,
    start: AtomicUsize,
    end: AtomicUsize,
    faulted: AtomicBool,
}

#[allow(clippy::declare_interior_mutable_const)]
const FREE: Slot = Slot {
    busy: AtomicBool::new(false),
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    faulted: AtomicBool::new(false),
};
static SLOT: [Slot; SLOTS] = [FREE; SLOTS];

/// The SIGBUS action before ours, written under `INSTALL` before ours is installed.
struct Previous(std::cell::UnsafeCell<Option<libc::sigaction>>);
// SAFETY: written only under `INSTALL` while our handler is not the installed one; read by it.
unsafe impl Sync for Previous {}
static PREVIOUS: Previous = Previous(std::cell::UnsafeCell::new(None));
static INSTALL: Mutex<()> = Mutex::new(());
/// The page size, read before the handler is installed (it reads it: no libc call in there).
static PAGE: AtomicUsize = AtomicUsize::new(4096);

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel hands a valid siginfo to an SA_SIGINFO handler.
    let addr = unsafe { (*info).si_addr() } as usize;
    for s in &SLOT {
        let (start, end) = (
            s.start.load(Ordering::Acquire),
            s.end.load(Ordering::Acquire),
        );
        if start <= addr && addr < end {
            let page = addr & !(PAGE.load(Ordering::Relaxed) - 1);
            // Marked first: a thread that reads the zero pages then sees the mark.
            s.faulted.store(true, Ordering::Release);
            // SAFETY: replaces pages of our own registered mapping (async-signal-safe syscall).
            let r = unsafe {
                libc::mmap(
                    page as *mut libc::c_void,
                    end - page,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                    -1,
                    0,
                )
            };
            if r != libc::MAP_FAILED {
                return; // the faulting access runs again, on a zero page
            }
        }
    }
    // Not ours: what would have happened without us.
    // SAFETY: PREVIOUS was set before this handler was installed and is not written while it is.
    let prev = unsafe { *PREVIOUS.0.get() };
    match prev {
        Some(p) if p.sa_sigaction != libc::SIG_DFL && p.sa_sigaction != libc::SIG_IGN => unsafe {
            if p.sa_flags & libc::SA_SIGINFO != 0 {
                let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                    std::mem::transmute(p.sa_sigaction);
                f(sig, info, ctx)
            } else {
                let f: extern "C" fn(libc::c_int) = std::mem::transmute(p.sa_sigaction);
                f(sig)
            }
        },
        _ => unsafe {
            // The default action: death by the signal (a fault or one sent by kill alike).
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGBUS, &dfl, std::ptr::null_mut());
            libc::raise(libc::SIGBUS);
        },
    }
}

/// Makes `on_sigbus` the SIGBUS handler, unless it is already (another library, or Python's
/// faulthandler, may have replaced it since: it is then chained to). False if that failed.
fn ensure_handler() -> bool {
    let _guard = INSTALL.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: plain sigaction calls; PREVIOUS is written while our handler is not installed.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGBUS, std::ptr::null(), &mut cur) != 0 {
            return false;
        }
        if cur.sa_sigaction == on_sigbus as *const () as usize {
            return true;
        }
        PAGE.store(page_size(), Ordering::Relaxed);
        *PREVIOUS.0.get() = Some(cur);
        let mut ours: libc::sigaction = std::mem::zeroed();
        ours.sa_sigaction = on_sigbus as *const () as usize;
        ours.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_NODEFER;
        libc::sigemptyset(&mut ours.sa_mask);
        libc::sigaction(libc::SIGBUS, &ours, std::ptr::null_mut()) == 0
    }
}

/// Whether every page of the file's bytes `at..at + len` (`at` a page's start, `len` > 0) is in
/// the page cache, asked of the kernel in one call (`cachestat`, Linux 6.5 on: 0.05 ms for
/// 512 MiB on this project's build machine, where `mincore` looks up each page, 9 ms); `None`
/// where the call failed (a kernel without it: then never asked again).
fn all_cached(file: &File, at: usize, len: usize, page: usize) -> Option<bool> {
    #[cfg(target_os = "linux")]
    {
        static MISSING: AtomicBool = AtomicBool::new(false);
        #[repr(C)]
        struct Range {
            off: u64,
            len: u64,
        }
        #[repr(C)]
        #[derive(Default)]
        struct Stat {
            nr_cache: u64,
            nr_dirty: u64,
            nr_writeback: u64,
            nr_evicted: u64,
            nr_recently_evicted: u64,
        }
        // The same number on every architecture (the table all share from 424 on).
        const SYS_CACHESTAT: libc::c_long = 451;
        if MISSING.load(Ordering::Relaxed) {
            return None;
        }
        let range = Range {
            off: at as u64,
            len: len as u64,
        };
        let mut stat = Stat::default();
        // SAFETY: the call reads `range` and writes `stat`, both ours and of the kernel's layout.
        let r = unsafe {
            libc::syscall(
                SYS_CACHESTAT,
                file.as_raw_fd(),
                &range as *const Range,
                &mut stat as *mut Stat,
                0u32,
            )
        };
        if r != 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
                MISSING.store(true, Ordering::Relaxed);
            }
            return None;
        }
        Some(stat.nr_cache == len.div_ceil(page) as u64)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (file, at, len, page);
        None
    }
}

/// A registered read-only mapping of the first `len` bytes of a file, made once and shared by the
/// threads that copy out of it (a mapping per copy would take the process's memory-map lock for
/// writing each time, stalling every other thread's page faults).
pub(crate) struct MappedFile {
    base: *mut libc::c_void,
    len: usize,
    slot: &'static Slot,
    /// Bytes copied out since its pages were last let go of (`copy`).
    held: AtomicU64,
}

// SAFETY: a read-only mapping, read through raw pointers only.
unsafe impl Send for MappedFile {}
unsafe impl Sync for MappedFile {}

impl MappedFile {
    /// `None` where the file cannot be mapped (or every slot is taken): the caller reads instead.
    pub(crate) fn new(file: &File, len: u64) -> Option<MappedFile> {
        let len = usize::try_from(len).ok().filter(|&n| n > 0)?;
        if !ensure_handler() {
            return None;
        }
        let slot = SLOT.iter().find(|s| {
            s.busy
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })?;
        // SAFETY: a fresh shared read-only mapping of an open file; unmapped in Drop.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            slot.busy.store(false, Ordering::Release);
            return None;
        }
        slot.faulted.store(false, Ordering::Relaxed);
        slot.end.store(base as usize + len, Ordering::Release);
        slot.start.store(base as usize, Ordering::Release);
        Some(MappedFile {
            base,
            len,
            slot,
            held: AtomicU64::new(0),
        })
    }

    /// Whether every page of bytes `at..at + len` of `file` (the file mapped) is in the page
    /// cache. A page that is not would be read from storage by a fault, a page or a few at a time,
    /// where a read of the range asks for it whole.
    pub(crate) fn resident(&self, file: &File, at: u64, len: u64) -> bool {
        let page = page_size();
        let (Ok(start), Ok(len)) = (usize::try_from(at), usize::try_from(len)) else {
            return false;
        };
        let first = start / page * page;
        let Some(end) = start.checked_add(len).filter(|&e| e <= self.len) else {
            return false;
        };
        if end == first {
            return true;
        }
        all_cached(file, first, end - first, page)
            .unwrap_or_else(|| self.all_mapped_cached(first, end - first, page))
    }

    /// [`all_cached`] by `mincore` over the mapping (`at` a page's start).
    fn all_mapped_cached(&self, at: usize, len: usize, page: usize) -> bool {
        let mut vec = vec![0u8; len.div_ceil(page)];
        // SAFETY: a page-aligned range inside our mapping, and a vector of one byte per page.
        let r = unsafe {
            libc::mincore(
                (self.base as *mut u8).add(at) as *mut libc::c_void,
                len,
                vec.as_mut_ptr(),
            )
        };
        r == 0 && vec.iter().all(|v| v & 1 == 1)
    }

    /// Runs `copies` out of bytes `at..` of the file (`fused`). `UnexpectedEof` where they reach
    /// past its end, or where the file was cut short under the mapping (here or in another copy
    /// out of it: the bytes may then be zeros).
    pub(crate) fn copy(&self, at: u64, copies: &mut Copies<'_>) -> std::io::Result<()> {
        let reach = at
            .checked_add(copies.reach())
            .and_then(|e| usize::try_from(e).ok());
        if !fused::available() || reach.is_none_or(|e| e > self.len) {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        // Mapped pages count in the process's RSS (and in what the OOM killer weighs): let go of
        // all of them each time copies of another `HELD` bytes have started (the page cache keeps
        // them; a copy under way faults its own back in). Counted as copies start, so that the
        // pages of those still under way count too. Rarely: each time is a flush of the TLBs of
        // the process's other threads.
        let n = copies.bytes();
        if self.held.fetch_add(n, Ordering::Relaxed) + n >= HELD {
            self.held.store(0, Ordering::Relaxed);
            // SAFETY: advice on our own read-only shared mapping, whole.
            unsafe { libc::madvise(self.base, self.len, libc::MADV_DONTNEED) };
        }
        // SAFETY: the copies stay inside the mapping (checked above); a page the file lost under
        // us reads as zeros (`on_sigbus`) and the copy is then refused below.
        unsafe { copies.run((self.base as *const u8).add(at as usize)) };
        if self.slot.faulted.load(Ordering::Acquire) {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        self.slot.start.store(0, Ordering::Release);
        self.slot.end.store(0, Ordering::Release);
        // SAFETY: our own mapping, no longer read.
        unsafe { libc::munmap(self.base, self.len) };
        self.slot.busy.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    fn file_of(bytes: &[u8]) -> (tempfile::NamedTempFile, File) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        let r = File::open(f.path()).unwrap();
        (f, r)
    }

    /// Runs plain copies of `parts` (`(offset from at, destination)`) out of `map`.
    fn copy_parts(
        map: &MappedFile,
        at: u64,
        parts: &mut [(u64, &mut [u8])],
    ) -> std::io::Result<()> {
        let mut c = Copies::new(false);
        for (off, dst) in parts.iter_mut() {
            c.copy(*off, dst);
            c.end_stream();
        }
        map.copy(at, &mut c)
    }

    #[test]
    fn pieces_come_out_as_written() {
        if !fused::available() {
            return;
        }
        let data: Vec<u8> = (0..3 * 4096 + 123).map(|i| (i * 7 % 251) as u8).collect();
        let (_f, file) = file_of(&data);
        let map = MappedFile::new(&file, data.len() as u64).unwrap();
        let (mut a, mut b) = (vec![0u8; 10], vec![0u8; 5000]);
        copy_parts(&map, 100, &mut [(1u64, &mut a[..]), (4000u64, &mut b[..])]).unwrap();
        assert_eq!(a, data[101..111]);
        assert_eq!(b, data[4100..9100]);
        let e = copy_parts(&map, data.len() as u64 - 5, &mut [(0u64, &mut a[..])]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        // Just written: in the page cache (the range past the end is not a range of the file).
        assert!(map.resident(&file, 100, 9000));
        assert!(!map.resident(&file, 100, data.len() as u64));
        // Dropped from the cache (as far as the kernel will), then faulted back in by a copy.
        // SAFETY: plain advice on an open file.
        unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        let dropped = !map.resident(&file, 0, 4096);
        let mut c = [0u8; 4];
        copy_parts(&map, 0, &mut [(0, &mut c[..])]).unwrap();
        assert!(!dropped || map.resident(&file, 0, 4096));
    }

    #[test]
    fn the_kernel_asked_once_says_what_mincore_says_page_by_page() {
        let page = page_size();
        let data = vec![5u8; 16 * page];
        let (_f, file) = file_of(&data);
        file.sync_all().unwrap();
        // All but pages 5 and 6 in the cache (as far as the kernel will): the file dropped, then
        // read back a page at a time without reading ahead.
        // SAFETY: plain advice on an open file.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM);
        }
        for p in (0..16).filter(|p| !(5..7).contains(p)) {
            file.read_exact_at(&mut [0u8; 1], (p * page) as u64)
                .unwrap();
        }
        let map = MappedFile::new(&file, data.len() as u64).unwrap();
        let ranges = [
            (0, 1),
            (0, 5),
            (0, 6),
            (4, 1),
            (4, 2),
            (5, 1),
            (6, 1),
            (6, 2),
            (7, 9),
            (0, 16),
        ];
        let mut asked = 0;
        for (at, n) in ranges {
            let by_page = map.all_mapped_cached(at * page, n * page, page);
            if let Some(all) = all_cached(&file, at * page, n * page, page) {
                assert_eq!(all, by_page, "pages {at}..{}", at + n);
                asked += 1;
            }
            // Inside the file's last page: a range of bytes, not of whole pages.
            assert_eq!(
                map.resident(&file, (at * page + 7) as u64, (n * page - 7) as u64),
                by_page
            );
        }
        // This project's machines have the call (Linux 6.5 on); elsewhere mincore answers alone.
        let linux = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let new = linux
            .split('.')
            .take(2)
            .map(|v| v.parse::<u32>().unwrap_or(0))
            .collect::<Vec<_>>();
        if new >= vec![6, 5] {
            assert_eq!(asked, ranges.len());
        }
    }

    #[test]
    fn a_file_cut_short_under_the_mapping_is_a_short_read_not_a_crash() {
        if !fused::available() {
            return;
        }
        let data = vec![5u8; 64 << 10];
        let (f, file) = file_of(&data);
        let map = MappedFile::new(&file, data.len() as u64).unwrap();
        f.as_file().set_len(1000).unwrap();
        let mut got = [9u8; 16];
        let e = copy_parts(&map, 40_000, &mut [(0, &mut got[..])]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        assert_eq!(got, [0u8; 16]);
        // Every later copy out of it is refused too, even of bytes the file still has.
        let e = copy_parts(&map, 0, &mut [(0, &mut got[..])]).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
