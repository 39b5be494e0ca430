//! A client of torch.distributed's `TCPStore`, the rendezvous store of every torchrun / `env://`
//! job, speaking its wire protocol over its own socket, and the heartbeat the ranks' liveness rests
//! on.
//!
//! Why in the core: a heartbeat sent by a Python thread stops whenever the interpreter is held by
//! one long C call (a big `torch.cat`, a compile), and a live rank is then declared dead. The
//! thread here never takes the GIL. Every call has a deadline (a socket timeout), so a frozen
//! server (its process stopped) ends in an error, never a hang, and a timed wait is cancelled the
//! way torch's own client cancels it, so nothing is printed.
//!
//! The protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp, the same since torch 2.0 for the
//! queries used here): one query byte, then keys as u64 length + bytes (the client's keys carry a
//! leading "/"), values as u64 length + bytes, integers as little-endian i64. `set` and `append`
//! have no answer; `get`, `add`, `check`, `wait`, `multi_get` and `delete` do.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{is_own_shortage, no_thread};

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const DELETE_KEY: u8 = 8;
const APPEND: u8 = 9;
const MULTI_GET: u8 = 10;
const CANCEL_WAIT: u8 = 12;
const MAGIC: u32 = 0x3C85_F7CE;
const READY: u8 = 0;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// The largest value this client accepts from the server (the store is not ours to trust blindly).
const MAX_VALUE: u64 = 1 << 32;

/// One connection to a TCPStore server. Not shared between threads (wrap it in a mutex).
pub struct StoreClient {
    stream: TcpStream,
    timeout: Duration,
    /// Added delay per round trip (a benchmark's model of a cluster's network); zero otherwise.
    rtt: Duration,
    out: Vec<u8>,
    requests: u64,
}

fn timed_out(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

impl StoreClient {
    /// Connects to the store at `host:port`, retrying refused or dropped connections (a server
    /// thousands of ranks connect to at once drops some) until `timeout`; `timeout` also bounds
    /// every later call.
    pub fn connect(host: &str, port: u16, timeout: Duration, rtt: Duration) -> io::Result<Self> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(10);
        loop {
            match Self::try_connect(host, port, timeout, rtt) {
                Ok(c) => return Ok(c),
                Err(e)
                    if Instant::now() + pause < deadline
                        && e.kind() != io::ErrorKind::InvalidInput
                        && !is_own_shortage(&e) =>
                {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Bounds every later call by `timeout` instead.
    pub fn set_timeout(&mut self, timeout: Duration) -> io::Result<()> {
        self.stream.set_read_timeout(Some(timeout))?;
        self.stream.set_write_timeout(Some(timeout))?;
        self.timeout = timeout;
        Ok(())
    }

    fn try_connect(host: &str, port: u16, timeout: Duration, rtt: Duration) -> io::Result<Self> {
        let addrs: Vec<_> = (host, port).to_socket_addrs()?.collect();
        let mut last = io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{host}:{port} resolves to no address"),
        );
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout.min(Duration::from_secs(5))) {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    stream.set_read_timeout(Some(timeout))?;
                    stream.set_write_timeout(Some(timeout))?;
                    let mut client = StoreClient {
                        stream,
                        timeout,
                        rtt,
                        out: Vec::new(),
                        requests: 0,
                    };
                    client.out.push(VALIDATE);
                    client.out.extend_from_slice(&MAGIC.to_le_bytes());
                    client.flush()?;
                    return Ok(client);
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    fn query(&mut self, q: u8) {
        self.out.push(q);
        self.requests += 1;
    }

    /// Queries sent so far (a pipelined batch counts each of its queries).
    pub fn requests(&self) -> u64 {
        self.requests
    }

    fn key(&mut self, key: &str) {
        self.out
            .extend_from_slice(&(key.len() as u64 + 1).to_le_bytes());
        self.out.push(b'/');
        self.out.extend_from_slice(key.as_bytes());
    }

    fn value(&mut self, value: &[u8]) {
        self.out
            .extend_from_slice(&(value.len() as u64).to_le_bytes());
        self.out.extend_from_slice(value);
    }

    fn keys(&mut self, keys: &[&str]) {
        self.out
            .extend_from_slice(&(keys.len() as u64).to_le_bytes());
        for k in keys {
            self.key(k);
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        let r = self.stream.write_all(&self.out);
        self.out.clear();
        r
    }

    fn round_trip(&mut self) -> io::Result<()> {
        if !self.rtt.is_zero() {
            std::thread::sleep(self.rtt);
        }
        self.flush()
    }

    fn read_u8(&mut self) -> io::Result<u8> {
        let mut b = [0u8; 1];
        self.stream.read_exact(&mut b)?;
        Ok(b[0])
    }

    fn read_u64(&mut self) -> io::Result<u64> {
        let mut b = [0u8; 8];
        self.stream.read_exact(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn read_value(&mut self) -> io::Result<Vec<u8>> {
        let n = self.read_u64()?;
        if n > MAX_VALUE {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the store sent a {n}-byte value"),
            ));
        }
        let mut v = vec![0u8; n as usize];
        self.stream.read_exact(&mut v)?;
        Ok(v)
    }

    /// Sets `key` to `value` (no answer: the next answered call orders after it).
    pub fn set(&mut self, key: &str, value: &[u8]) -> io::Result<()> {
        self.query(SET);
        self.key(key);
        self.value(value);
        self.flush()
    }

    /// Sets many keys in one write.
    pub fn set_many(&mut self, items: &[(&str, &[u8])]) -> io::Result<()> {
        for (k, v) in items {
            self.query(SET);
            self.key(k);
            self.value(v);
        }
        self.flush()
    }

    /// Appends `value` to `key` (created empty if absent); atomic against other clients' appends.
    pub fn append(&mut self, key: &str, value: &[u8]) -> io::Result<()> {
        self.query(APPEND);
        self.key(key);
        self.value(value);
        self.flush()
    }

    /// The value of `key`, which must exist (check or wait first: the server drops a client
    /// asking for a missing key).
    pub fn get(&mut self, key: &str) -> io::Result<Vec<u8>> {
        self.query(GET);
        self.key(key);
        self.round_trip()?;
        self.read_value()
    }

    /// The values of `keys`, which must all exist.
    pub fn multi_get(&mut self, keys: &[&str]) -> io::Result<Vec<Vec<u8>>> {
        self.query(MULTI_GET);
        self.keys(keys);
        self.round_trip()?;
        (0..keys.len()).map(|_| self.read_value()).collect()
    }

    /// Adds `delta` to the integer at `key` (0 if absent) and returns the new value.
    pub fn add(&mut self, key: &str, delta: i64) -> io::Result<i64> {
        self.query(ADD);
        self.key(key);
        self.out.extend_from_slice(&delta.to_le_bytes());
        self.round_trip()?;
        Ok(self.read_u64()? as i64)
    }

    /// True if every key in `keys` exists.
    pub fn check(&mut self, keys: &[&str]) -> io::Result<bool> {
        self.query(CHECK);
        self.keys(keys);
        self.round_trip()?;
        Ok(self.read_u8()? == READY)
    }

    /// Deletes each of `keys` (pipelined: one write, then the answers); returns how many existed.
    pub fn delete(&mut self, keys: &[&str]) -> io::Result<usize> {
        for k in keys {
            self.query(DELETE_KEY);
            self.key(k);
        }
        self.round_trip()?;
        let mut n = 0;
        for _ in keys {
            n += usize::from(self.read_u64()? != 0);
        }
        Ok(n)
    }

    /// Waits until every key in `keys` exists: true, or false once `timeout` passed (the wait is
    /// then cancelled on the server, as torch's client does).
    pub fn wait(&mut self, keys: &[&str], timeout: Duration) -> io::Result<bool> {
        self.query(WAIT);
        self.keys(keys);
        self.round_trip()?;
        self.stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
        let mut b = [0u8; 1];
        // A signal handled by the process interrupts a read with a timeout (EINTR even under
        // SA_RESTART): read again, the wait is still on.
        let got = loop {
            match self.stream.read(&mut b) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                got => break got,
            }
        };
        self.stream.set_read_timeout(Some(self.timeout))?;
        match got {
            Ok(1) if b[0] == STOP_WAITING => Ok(true),
            Ok(0) => Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the store closed the connection",
            )),
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "unexpected answer to a wait",
            )),
            Err(e) if timed_out(&e) => {
                self.query(CANCEL_WAIT);
                self.flush()?;
                // The keys may have appeared just before the cancel arrived: then the wait's own
                // answer comes first, and the cancel's after it.
                match self.read_u8()? {
                    WAIT_CANCELED => Ok(false),
                    STOP_WAITING if self.read_u8()? == WAIT_CANCELED => Ok(true),
                    _ => Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "unexpected answer to a cancelled wait",
                    )),
                }
            }
            Err(e) => Err(e),
        }
    }
}

/// A thread bumping `key` in the store every `interval` until stopped (or dropped). It holds its
/// own connection and reconnects after a failure; it never touches Python. Between beats it sleeps
/// on a condition variable (woken by `stop` and `set_interval`), not in polling slices: at
/// thousands of ranks per host, as `benches/coord_scale.py` simulates, slices of 50 ms were 20
/// wake-ups per second per rank.
pub struct Heartbeat {
    shared: Arc<Shared>,
    /// The thread, and the end of a channel whose other end it drops as it ends (`stop`).
    thread: Mutex<Option<(JoinHandle<()>, mpsc::Receiver<()>)>>,
}

/// What the heartbeat's thread and its owner share.
struct Shared {
    beat: Mutex<Beat>,
    wake: Condvar,
    beats: AtomicU64,
    silences: Mutex<Silences>,
}

/// The gaps between this process's beats as its peers see them: how long it was silent.
struct Silences {
    /// When the last beat landed, and the interval it was sent under.
    last: Instant,
    every: Duration,
    /// Gaps of more than two beats, `(when it ended, how long)`, oldest first and each shorter
    /// than the one before: a gap no longer than a later one never tells a window more than that
    /// one (windows end now), so it is dropped. At most [`SILENCES_KEPT`]: beyond, the newest two
    /// merge into one as long as the longer, which can only make a window's silence longer.
    long: std::collections::VecDeque<(Instant, Duration)>,
}

const SILENCES_KEPT: usize = 64;

impl Silences {
    /// A beat landed, sent under `interval`. A gap counts if it was over two beats of both the
    /// interval it followed and this one: a beat overdue because the interval just shrank (a
    /// call with a shorter peer_timeout) is no silence.
    fn landed(&mut self, interval: Duration) {
        let now = Instant::now();
        let gap = now - self.last;
        let allowed = 2 * self.every.max(interval);
        (self.last, self.every) = (now, interval);
        if gap > allowed {
            while self.long.back().is_some_and(|&(_, g)| g <= gap) {
                self.long.pop_back();
            }
            let mut gap = gap;
            if self.long.len() == SILENCES_KEPT {
                gap = self.long.pop_back().map_or(gap, |(_, longer)| longer);
            }
            self.long.push_back((now, gap));
        }
    }

    /// The longest silence in the window from `since` to now, counting only the part of each
    /// gap (ended, or going on) inside it.
    fn longest(&self, since: Option<Instant>) -> Duration {
        let now = Instant::now();
        let inside = |end: Instant, gap: Duration| match since {
            Some(since) => end.saturating_duration_since((end - gap).max(since)),
            None => gap,
        };
        let going_on = now - self.last;
        let going_on = if going_on > 2 * self.every {
            inside(now, going_on)
        } else {
            Duration::ZERO
        };
        self.long
            .iter()
            .map(|&(end, gap)| inside(end, gap))
            .fold(going_on, Duration::max)
    }
}

struct Beat {
    stop: bool,
    interval: Duration,
}

impl Shared {
    fn beat(&self) -> MutexGuard<'_, Beat> {
        self.beat.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn silences(&self) -> MutexGuard<'_, Silences> {
        self.silences.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, f: impl FnOnce(&mut Beat)) {
        f(&mut self.beat());
        self.wake.notify_all();
    }

    /// Sleeps until the beat after the one at `last` is due; false once stopped.
    fn due(&self, last: Instant) -> bool {
        let mut beat = self.beat();
        loop {
            if beat.stop {
                return false;
            }
            let (due, now) = (last + beat.interval, Instant::now());
            if now >= due {
                return true;
            }
            beat = self
                .wake
                .wait_timeout(beat, due - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

/// How long `Heartbeat::stop` waits for a thread that is inside a store call (a reconnect to a
/// store whose host died retries for the whole timeout) before it leaves it behind.
const STOP_WAIT: Duration = Duration::from_millis(200);

impl Heartbeat {
    /// Connects (once, so that a bad address is an error here) and starts beating; `timeout`
    /// bounds the connect (a store whose host died refuses it: an error after `timeout`, never a
    /// long wait) and every later call.
    pub fn start(
        host: &str,
        port: u16,
        key: &str,
        interval: Duration,
        timeout: Duration,
    ) -> io::Result<Self> {
        let mut client = StoreClient::connect(host, port, timeout, Duration::ZERO)?;
        client.add(key, 1)?;
        let shared = Arc::new(Shared {
            beat: Mutex::new(Beat {
                stop: false,
                interval: interval.max(Duration::from_millis(1)),
            }),
            wake: Condvar::new(),
            beats: AtomicU64::new(1),
            silences: Mutex::new(Silences {
                last: Instant::now(),
                every: interval,
                long: Default::default(),
            }),
        });
        let sh = shared.clone();
        let (host, key) = (host.to_string(), key.to_string());
        let (done, ended) = mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("olmo-chunks-heartbeat".into())
            .spawn(move || {
                let _done = done; // dropped as the thread ends, however it ends
                let mut client = Some(client);
                let mut last = Instant::now();
                while sh.due(last) {
                    last = Instant::now();
                    if client.is_none() {
                        client = StoreClient::connect(&host, port, timeout, Duration::ZERO).ok();
                        if sh.beat().stop {
                            return; // stopped while reconnecting: no beat after `stop`
                        }
                    }
                    match client.as_mut().map(|c| c.add(&key, 1)) {
                        Some(Ok(_)) => {
                            sh.beats.fetch_add(1, Ordering::Relaxed);
                            let interval = sh.beat().interval;
                            sh.silences().landed(interval);
                        }
                        _ => client = None,
                    }
                }
            })
            .map_err(no_thread)?;
        Ok(Heartbeat {
            shared,
            thread: Mutex::new(Some((thread, ended))),
        })
    }

    /// Beats at least every `interval` from now on.
    pub fn set_interval(&self, interval: Duration) {
        self.shared
            .set(|b| b.interval = interval.max(Duration::from_millis(1)));
    }

    /// Beats sent so far.
    pub fn beats(&self) -> u64 {
        self.shared.beats.load(Ordering::Relaxed)
    }

    /// The longest this process went without a beat landing (over two beats) within the last
    /// `within`: what its peers saw. A frozen process (SIGSTOP, a paused VM, a swap storm) or a
    /// store that stopped answering it shows here; a GIL held by one long call does not (the
    /// thread is native).
    pub fn longest_silence(&self, within: Duration) -> Duration {
        self.shared
            .silences()
            .longest(Instant::now().checked_sub(within))
    }

    /// Stops the thread: no beat starts after this returns. Waits for the thread to end, at most
    /// `STOP_WAIT` where it is inside a store call (reconnecting to a store whose host died, which
    /// retries for the whole timeout): joining it, a heartbeat dropped after its store's host
    /// died (one held by `__main__`, at exit) took that timeout. The thread left behind ends
    /// after that call.
    pub fn stop(&self) {
        self.shared.set(|b| b.stop = true);
        let taken = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some((thread, ended)) = taken {
            if let Err(mpsc::RecvTimeoutError::Disconnected) = ended.recv_timeout(STOP_WAIT) {
                let _ = thread.join();
            }
        }
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silences_count_gaps_of_over_two_beats_inside_the_window() {
        let ms = Duration::from_millis;
        let every = ms(10);
        let start = Instant::now() - ms(2000);
        let mut s = Silences {
            last: start,
            every,
            long: Default::default(),
        };
        // A freeze of about 2 s ends now: all of it counts in an open window, its last 0.5 s in
        // one that began 0.5 s ago.
        s.landed(every);
        let all = s.longest(None);
        assert!(all >= ms(2000) && all < ms(2500), "{all:?}");
        let part = s.longest(Some(Instant::now() - ms(500)));
        assert!(part >= ms(490) && part <= ms(520), "{part:?}");
        assert_eq!(s.longest(Some(Instant::now())), Duration::ZERO);
        // Shorter gaps after it do not push it out.
        for _ in 0..3 * SILENCES_KEPT {
            s.last -= ms(100);
            s.landed(every);
        }
        assert!(s.long.len() <= SILENCES_KEPT, "{:?}", s.long);
        assert!(s.longest(None) >= ms(2000));
        // Gaps each a little shorter than the last, more than are kept: the longest is not lost.
        s.long.clear();
        s.last -= ms(3000);
        s.landed(every);
        for i in 0..2 * SILENCES_KEPT as u64 {
            s.last -= ms(2000 - i);
            s.landed(every);
        }
        assert_eq!(s.long.len(), SILENCES_KEPT);
        assert!(s.longest(None) >= ms(3000));
        // A beat overdue because the interval shrank is no silence.
        s.every = ms(2000);
        s.last -= ms(1900);
        let before = s.long.len();
        s.landed(ms(500));
        assert_eq!(s.long.len(), before);
        assert_eq!(s.every, ms(500));
        // One going on counts once over two beats (of 500 ms now), from the window's start.
        s.long.clear();
        s.last = Instant::now() - ms(1500);
        let going = s.longest(Some(Instant::now() - ms(1000)));
        assert!(going >= ms(1000) && going < ms(1100), "{going:?}");
        s.last = Instant::now() - ms(900);
        assert_eq!(s.longest(None), Duration::ZERO);
    }
}
