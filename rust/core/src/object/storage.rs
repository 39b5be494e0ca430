//! [`ObjectStorage`]: one checkpoint's prefix of a bucket, its requests and their errors.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures_util::{StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{
    GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    UpdateVersion,
};
use tokio::runtime::Runtime;

use super::client::{
    bucket_for, forget, no_panic, retry_budget, runtime, split_url, Breaker, Bucket,
};
use super::transfer::{RemoteReader, RemoteWriter};
use super::{MAX_PARTS, MERGE_GAP, PART_SIZE, REQUEST_BYTES};
use crate::error::{CoreError, Result};
use crate::storage::{
    Entry, Head, HeadCheck, IoCounters, Object, PutIf, ReadMerge, Storage, Version,
};
use crate::txn::{CLOCK_PREFIX, MAX_LEASE_LEN, UPLOAD_SUFFIX};

/// Clock probes written before [`ObjectStorage::clock`] gives up on probes that vanish.
const CLOCK_TRIES: u32 = 3;

/// A prefix of a bucket, holding one checkpoint.
#[derive(Clone)]
pub struct ObjectStorage {
    pub(super) bucket: Arc<Bucket>,
    runtime: Arc<Runtime>,
    /// `scheme://bucket/prefix`, for names in errors.
    url: String,
    prefix: String,
    /// Smallest part of a multipart upload.
    part_size: u64,
    merge: ReadMerge,
}

fn io_kind(e: &object_store::Error) -> std::io::ErrorKind {
    use object_store::Error as E;
    use std::io::ErrorKind as K;
    match e {
        E::NotFound { .. } => K::NotFound,
        E::AlreadyExists { .. } => K::AlreadyExists,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => K::PermissionDenied,
        _ => K::Other,
    }
}

/// True for a store's answer that the bucket itself does not exist.
fn is_missing_bucket(e: &object_store::Error) -> bool {
    let msg = e.to_string();
    matches!(e, object_store::Error::NotFound { .. })
        && (msg.contains("NoSuchBucket") || msg.contains("bucket does not exist"))
}

pub(super) fn to_io(e: object_store::Error) -> std::io::Error {
    std::io::Error::new(io_kind(&e), e)
}

/// The errors of requests: which say the server failed (a transport error or a 5xx, once the
/// retries ran out, as against an answer such as a 404 or a failed condition), and the error of
/// one the [`Breaker`] cut short.
pub(super) trait Unanswered {
    fn unanswered(after: Duration) -> Self;
    fn server_failed(&self) -> bool;
    /// The error for settings the client panicked on (`client::no_panic`).
    fn refused(e: CoreError) -> Self;
}

/// Whether `e` of an object store's request leaves its outcome unknown: no definite answer came
/// (a connection failed, a 5xx, a timeout), so a write may have landed, or land later.
pub(crate) fn indefinite(e: &CoreError) -> bool {
    e.server_failed()
}

fn unanswered_io(after: Duration) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "no answer within {after:?}, just after another request to this bucket failed for \
             good (the server is gone or hung)"
        ),
    )
}

impl Unanswered for std::io::Error {
    fn unanswered(after: Duration) -> Self {
        unanswered_io(after)
    }

    fn refused(e: CoreError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())
    }

    fn server_failed(&self) -> bool {
        use std::io::ErrorKind as K;
        let inner = self
            .get_ref()
            .and_then(|e| e.downcast_ref::<object_store::Error>());
        if let Some(e) = inner {
            return e.server_failed(); // (`to_io`)
        }
        matches!(
            self.kind(),
            K::Other
                | K::TimedOut
                | K::ConnectionRefused
                | K::ConnectionReset
                | K::ConnectionAborted
                | K::NotConnected
                | K::BrokenPipe
        )
    }
}

impl Unanswered for object_store::Error {
    fn unanswered(after: Duration) -> Self {
        object_store::Error::Generic {
            store: "olmo-chunks",
            source: Box::new(unanswered_io(after)),
        }
    }

    /// A Generic error (a connection, a 5xx), not a client error of the HTTP answer (a 4xx other
    /// than 408 and 429: the server answered).
    fn server_failed(&self) -> bool {
        let object_store::Error::Generic { source, .. } = self else {
            return false;
        };
        let text = source.to_string();
        let status = text
            .split_once("non-2xx status code: ")
            .map(|(_, rest)| rest.chars().take(3).collect::<String>());
        !matches!(status.as_deref(), Some(s) if s.starts_with('4') && s != "408" && s != "429")
    }

    fn refused(e: CoreError) -> Self {
        object_store::Error::Generic {
            store: "olmo-chunks",
            source: Box::new(e),
        }
    }
}

impl Unanswered for CoreError {
    fn unanswered(after: Duration) -> Self {
        CoreError::io("object store", unanswered_io(after))
    }

    fn server_failed(&self) -> bool {
        matches!(self, CoreError::Io { source, .. } if source.server_failed())
    }

    fn refused(e: CoreError) -> Self {
        e
    }
}

impl ObjectStorage {
    /// The storage at `url` (`s3://bucket/prefix` or `gs://bucket/prefix`). Its objects lie at
    /// the keys the prefix names, as written.
    pub fn open(url: &str) -> Result<Self> {
        let (scheme, bucket, prefix) = split_url(url)?;
        Ok(ObjectStorage {
            bucket: bucket_for(&scheme, &bucket)?,
            runtime: runtime()?,
            url: format!("{scheme}://{bucket}/{prefix}")
                .trim_end_matches('/')
                .into(),
            prefix,
            part_size: PART_SIZE,
            merge: read_merge()?,
        })
    }

    /// The URL of the prefix where releases before 2026-12-07 saved this one's checkpoint: they
    /// percent-encoded some characters of a prefix (`~`, `*`, `#`, `%`, non-ASCII, ...: the
    /// encoding of object_store's `Path::from`). `None` where that is the prefix itself.
    pub fn encoded_url(&self) -> Option<String> {
        let encoded = ObjectPath::from(self.prefix.as_str()).to_string();
        (encoded != self.prefix).then(|| {
            let base = &self.url[..self.url.len() - self.prefix.len()];
            format!("{base}{encoded}")
        })
    }

    /// A prefix of a fresh in-memory store (which takes parts of any size), uploading in `part`
    /// bytes: the object store of tests.
    #[doc(hidden)]
    pub fn in_memory(part: u64) -> Result<Self> {
        let mem = Arc::new(object_store::memory::InMemory::new());
        Ok(ObjectStorage {
            bucket: Arc::new(Bucket {
                store: mem.clone(),
                multipart: mem,
                counters: Arc::default(),
                breaker: Breaker::new(retry_budget()?),
            }),
            runtime: runtime()?,
            url: "memory://b/p".into(),
            prefix: "p".into(),
            part_size: part,
            merge: read_merge()?,
        })
    }

    /// The key of `rel` below the prefix, as written (`Path::from` would percent-encode it); one
    /// that no key can be (a control character, from a crafted manifest) is encoded.
    fn key(&self, rel: &str) -> ObjectPath {
        let key = if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        };
        ObjectPath::parse(&key).unwrap_or_else(|_| ObjectPath::from(key))
    }

    /// Runs one request to completion from synchronous code, within the bucket's [`Breaker`].
    pub(super) fn block_on<T, E: Unanswered>(
        &self,
        fut: impl std::future::Future<Output = std::result::Result<T, E>>,
    ) -> std::result::Result<T, E> {
        let breaker = &self.bucket.breaker;
        self.bucket
            .counters
            .requests
            .fetch_add(1, Ordering::Relaxed);
        let start = Instant::now();
        let deadline = breaker.deadline();
        let run = || match deadline {
            None => Some(self.runtime.block_on(fut)),
            Some(d) => self
                .runtime
                .block_on(async { tokio::time::timeout(d, fut).await })
                .ok(),
        };
        let out = match no_panic(run) {
            Ok(Some(out)) => out,
            Ok(None) => return Err(E::unanswered(deadline.unwrap_or_default())), // not a failure of its own
            Err(panicked) => {
                forget(&self.bucket); // its settings may be mended before the next request
                return Err(E::refused(panicked));
            }
        };
        breaker.record(
            start,
            out.as_ref().map_or_else(E::server_failed, |_| false),
            out.is_ok(),
        );
        out
    }

    fn err(&self, rel: &str, e: object_store::Error) -> CoreError {
        if is_missing_bucket(&e) {
            return self.missing_bucket();
        }
        if let object_store::Error::Generic { source, .. } = &e {
            if let Some(CoreError::InvalidArgument(why)) = source.downcast_ref::<CoreError>() {
                return CoreError::InvalidArgument(why.clone()); // (`Unanswered::refused`)
            }
        }
        CoreError::io(self.name(rel), to_io(e))
    }

    /// A missing bucket is a wrong location, not a missing checkpoint or data file.
    fn missing_bucket(&self) -> CoreError {
        let bucket = self.url.split('/').nth(2).unwrap_or_default();
        let settings = if self.url.starts_with("gs://") {
            "GOOGLE_*"
        } else {
            "AWS_ENDPOINT_URL / AWS_REGION"
        };
        CoreError::InvalidArgument(format!(
            "{}: the bucket {bucket:?} does not exist at this endpoint (check the URL and \
             {settings}, or create the bucket)",
            self.url
        ))
    }

    /// Writes `bytes` to `rel` in `mode`; returns the new version, or `None` if the mode's
    /// condition did not hold (nothing was written).
    fn put(&self, rel: &str, bytes: &[u8], mode: PutMode) -> Result<Option<Version>> {
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        let payload = PutPayload::from(bytes.to_vec());
        match self.block_on(self.bucket.store.put_opts(&self.key(rel), payload, opts)) {
            Ok(r) => {
                self.bucket.counters.add_written(bytes.len() as u64);
                Ok(Some(Version {
                    e_tag: r.e_tag,
                    version: r.version,
                }))
            }
            Err(
                object_store::Error::Precondition { .. }
                | object_store::Error::AlreadyExists { .. },
            ) => Ok(None),
            Err(e) => Err(self.err(rel, e)),
        }
    }

    /// Reads `rel` whole with its version; `None` if it does not exist. `check` sees the object's
    /// size and its first `peek` bytes (all of it if shorter) before any more is fetched, so an
    /// object it refuses costs one request and at most those bytes, whatever its size; the body
    /// then streams into one buffer of that size.
    fn get_versioned(
        &self,
        rel: &str,
        peek: u64,
        check: HeadCheck<'_>,
    ) -> Result<Option<(Vec<u8>, Head)>> {
        let key = self.key(rel);
        let got = self.block_on(async {
            let r = match self
                .bucket
                .store
                .get_opts(&key, GetOptions::default())
                .await
            {
                Ok(r) => r,
                Err(e @ object_store::Error::NotFound { .. }) if !is_missing_bucket(&e) => {
                    return Ok(None)
                }
                Err(e) => return Err(self.err(rel, e)),
            };
            let meta = r.meta.clone();
            let want = peek.min(meta.size) as usize;
            if want == 0 {
                check(&[], meta.size)?;
            }
            let mut body = r.into_stream();
            let mut bytes = Vec::new();
            while let Some(part) = body.try_next().await.map_err(|e| self.err(rel, e))? {
                let before = bytes.len();
                bytes.extend_from_slice(&part);
                self.bucket.counters.add_read(part.len() as u64);
                if bytes.len() as u64 > meta.size {
                    return Err(CoreError::io(
                        self.name(rel),
                        std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            format!(
                                "the server sent more than the {} bytes it declared",
                                meta.size
                            ),
                        ),
                    ));
                }
                if before < want && bytes.len() >= want {
                    check(&bytes[..want], meta.size)?;
                    bytes.reserve_exact(meta.size as usize - bytes.len());
                }
            }
            Ok(Some((bytes, meta)))
        })?;
        Ok(got.map(|(bytes, meta)| (bytes, head_of(meta))))
    }

    fn mode(cond: PutIf<'_>) -> PutMode {
        match cond {
            PutIf::Absent => PutMode::Create,
            PutIf::Version(v) => PutMode::Update(UpdateVersion {
                e_tag: v.e_tag.clone(),
                version: v.version.clone(),
            }),
        }
    }
}

/// Plain transfers with `object_store` itself, for the benchmark's roofline: what the same bytes
/// cost as one client moves them, in requests of [`PART_SIZE`] bytes, `concurrency` in flight
/// (0: as many as a load has I/O workers).
impl ObjectStorage {
    /// Uploads object `rel` of `size` bytes (of no meaning): one PUT if it fits in a part, else a
    /// multipart upload.
    pub fn raw_put(&self, rel: &str, size: u64, concurrency: usize) -> Result<()> {
        let key = self.key(rel);
        let part = PART_SIZE.min(size.max(1)) as usize;
        let full = PutPayload::from(vec![0x5A_u8; part]);
        let concurrency = workers(concurrency);
        let counters = &self.bucket.counters;
        let store = &self.bucket.store;
        let done: object_store::Result<()> = no_panic(|| {
            self.runtime.block_on(async {
                if size <= PART_SIZE {
                    store
                        .put(&key, PutPayload::from(vec![0x5A_u8; size as usize]))
                        .await?;
                    counters.requests.fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                let mut upload = store.put_multipart(&key).await?;
                let mut parts = Vec::new();
                let mut left = size as usize;
                while left > 0 {
                    let n = left.min(part);
                    let payload = if n == part {
                        full.clone()
                    } else {
                        PutPayload::from(vec![0x5A_u8; n])
                    };
                    parts.push(upload.put_part(payload));
                    left -= n;
                }
                let n = parts.len() as u64;
                futures_util::stream::iter(parts)
                    .buffer_unordered(concurrency)
                    .try_collect::<Vec<()>>()
                    .await?;
                upload.complete().await?;
                counters.requests.fetch_add(n + 2, Ordering::Relaxed);
                Ok(())
            })
        })?;
        done.map_err(|e| self.err(rel, e))?;
        counters.add_written(size);
        Ok(())
    }

    /// Reads `(rel, offset, len)` ranges in ranged GETs of at most [`PART_SIZE`] bytes; returns
    /// the bytes read (dropped as they arrive).
    pub fn raw_get(&self, ranges: &[(String, u64, u64)], concurrency: usize) -> Result<u64> {
        let mut gets = Vec::new();
        for (rel, offset, len) in ranges {
            let key = self.key(rel);
            let mut at = *offset;
            while at < offset + len {
                let end = (at + PART_SIZE).min(offset + len);
                gets.push((key.clone(), at..end));
                at = end;
            }
        }
        let store = &self.bucket.store;
        let n = gets.len() as u64;
        let concurrency = workers(concurrency);
        let got: object_store::Result<Vec<usize>> = no_panic(|| {
            self.runtime.block_on(
                futures_util::stream::iter(gets)
                    .map(|(key, range)| async move {
                        store.get_range(&key, range).await.map(|b| b.len())
                    })
                    .buffer_unordered(concurrency)
                    .try_collect(),
            )
        })?;
        let read = got.map_err(|e| self.err("", e))?.iter().sum::<usize>() as u64;
        self.bucket
            .counters
            .requests
            .fetch_add(n, Ordering::Relaxed);
        self.bucket.counters.add_read(read);
        Ok(read)
    }
}

fn workers(concurrency: usize) -> usize {
    if concurrency == 0 {
        crate::io::default_workers()
    } else {
        concurrency
    }
}

fn head_of(meta: ObjectMeta) -> Head {
    Head {
        version: Version {
            e_tag: meta.e_tag,
            version: meta.version,
        },
        size: meta.size,
        modified: meta.last_modified.into(),
    }
}

/// Ranged reads of one object are merged across gaps of at most [`MERGE_GAP`] bytes into requests
/// of at most `OLMO_CHUNKS_REQUEST_MIB` MiB (default [`REQUEST_BYTES`]); as many are in flight
/// per rank as the load has workers (`OLMO_CHUNKS_THREADS`).
fn read_merge() -> Result<ReadMerge> {
    let max = match std::env::var("OLMO_CHUNKS_REQUEST_MIB") {
        Err(_) => REQUEST_BYTES,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(mib @ 1..=4096) => mib << 20,
            _ => {
                return Err(CoreError::InvalidArgument(format!(
                    "OLMO_CHUNKS_REQUEST_MIB={v:?}: expected a whole number of MiB from 1 to 4096"
                )))
            }
        },
    };
    Ok(ReadMerge {
        gap: MERGE_GAP,
        max,
    })
}

impl Storage for ObjectStorage {
    fn read_merge(&self) -> ReadMerge {
        self.merge
    }
    fn writes_land_late(&self) -> bool {
        true
    }
    fn name(&self, rel: &str) -> PathBuf {
        if rel.is_empty() {
            PathBuf::from(&self.url)
        } else {
            PathBuf::from(format!("{}/{rel}", self.url))
        }
    }

    fn open(&self, rel: &str) -> Result<Box<dyn Object>> {
        let key = self.key(rel);
        let meta = self
            .block_on(self.bucket.store.head(&key))
            .map_err(|e| self.err(rel, e))?;
        Ok(Box::new(RemoteReader {
            storage: self.clone(),
            key,
            size: meta.size,
        }))
    }

    fn get(&self, rel: &str) -> Result<Vec<u8>> {
        self.get_checked(rel, 0, &|_, _| Ok(()))
    }

    fn get_checked(&self, rel: &str, peek: u64, check: HeadCheck<'_>) -> Result<Vec<u8>> {
        match self.get_versioned(rel, peek, check)? {
            Some((bytes, _)) => Ok(bytes),
            None => Err(CoreError::io(
                self.name(rel),
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such object"),
            )),
        }
    }

    /// Refuses an object that exists: data objects are written once, under a fresh save id, so
    /// one that exists means a reused save id, whose live data must not be overwritten.
    fn create(&self, rel: &str, size: u64) -> Result<Box<dyn Object>> {
        if Storage::head(self, rel)?.is_some() {
            return Err(CoreError::InvalidArgument(format!(
                "{}: exists; refusing to overwrite it (data objects are written once, under a \
                 fresh save id: was a save plan reused?)",
                self.name(rel).display()
            )));
        }
        let fewest = size.div_ceil(MAX_PARTS);
        let part = if fewest > self.part_size {
            fewest.next_multiple_of(1 << 20)
        } else {
            self.part_size
        };
        let key = self.key(rel);
        let marker = format!("{rel}{UPLOAD_SUFFIX}");
        let upload = if size > part {
            let id = self
                .block_on(self.bucket.multipart.create_multipart(&key))
                .map_err(|e| self.err(rel, e))?;
            // Recorded before any part goes up, for the cleanup of a writer killed mid-upload.
            if let Err(e) = self.put(&marker, id.as_bytes(), PutMode::Overwrite) {
                let _ = self.block_on(self.bucket.multipart.abort_multipart(&key, &id));
                return Err(e);
            }
            Some(id)
        } else {
            None
        };
        let parts = size.div_ceil(part).max(1);
        Ok(Box::new(RemoteWriter {
            storage: self.clone(),
            key,
            marker: self.key(&marker),
            size,
            part,
            upload: Mutex::new(upload),
            parts: (0..parts).map(|_| Mutex::default()).collect(),
        }))
    }

    fn persist(&self, _rels: &[&str]) -> Result<()> {
        Ok(()) // an upload is durable once it completes
    }

    fn counters(&self) -> &Arc<IoCounters> {
        &self.bucket.counters
    }

    fn head(&self, rel: &str) -> Result<Option<Head>> {
        match self.block_on(self.bucket.store.head(&self.key(rel))) {
            Ok(meta) => Ok(Some(head_of(meta))),
            Err(e @ object_store::Error::NotFound { .. }) if !is_missing_bucket(&e) => Ok(None),
            Err(e) => Err(self.err(rel, e)),
        }
    }

    fn get_with_head(
        &self,
        rel: &str,
        peek: u64,
        check: HeadCheck<'_>,
    ) -> Result<Option<(Vec<u8>, Head)>> {
        self.get_versioned(rel, peek, check)
    }

    /// One LIST (`deep`), or one LIST with a delimiter, whose common prefixes are the
    /// [`Entry::Dir`]s.
    fn list(&self, prefix: &str, deep: bool) -> Result<Vec<Entry>> {
        let base = self.key(prefix);
        let base = (!base.as_ref().is_empty()).then_some(&base);
        let strip = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        let rel = |p: &ObjectPath| p.as_ref().strip_prefix(&strip).map(str::to_string);
        let store = &self.bucket.store;
        if deep {
            let metas: Vec<_> = self
                .block_on(store.list(base).try_collect::<Vec<_>>())
                .map_err(|e| self.err(prefix, e))?;
            return Ok(metas
                .iter()
                .filter_map(|m| rel(&m.location).map(Entry::Object))
                .collect());
        }
        let found = self
            .block_on(store.list_with_delimiter(base))
            .map_err(|e| self.err(prefix, e))?;
        Ok(found
            .objects
            .iter()
            .filter_map(|m| rel(&m.location).map(Entry::Object))
            .chain(
                found
                    .common_prefixes
                    .iter()
                    .filter_map(|p| rel(p).map(Entry::Dir)),
            )
            .collect())
    }

    fn delete(&self, rel: &str) -> Result<()> {
        match self.block_on(self.bucket.store.delete(&self.key(rel))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err(rel, e)),
        }
    }

    /// Also aborts the multipart uploads whose markers ([`UPLOAD_SUFFIX`]) are below `prefix`:
    /// those of a writer killed mid-upload, whose parts the store would otherwise keep. A marker
    /// is read only if it is as small as an upload id can be.
    fn delete_all(&self, prefix: &str) -> Result<()> {
        let entries = self.list(prefix, true)?;
        for rel in entries.iter().map(Entry::rel) {
            let Some(data) = rel.strip_suffix(UPLOAD_SUFFIX) else {
                continue;
            };
            let small = |_: &[u8], size: u64| {
                if size <= MAX_LEASE_LEN {
                    return Ok(());
                }
                Err(CoreError::InvalidArgument(format!("{size} bytes")))
            };
            if let Ok(id) = self.get_checked(rel, 0, &small) {
                let id = String::from_utf8_lossy(&id).into_owned();
                let _ = self.block_on(self.bucket.multipart.abort_multipart(&self.key(data), &id));
            }
        }
        for rel in entries.iter().map(Entry::rel) {
            self.delete(rel)?;
        }
        Ok(())
    }

    /// The server's: the time it stamps on a probe object, written and removed (three requests,
    /// made only to judge a lease that another writer holds). That writer's cleanup of the
    /// leftovers of dead saves may remove the probe before it is read: then another is written,
    /// up to `CLOCK_TRIES` in all.
    fn clock(&self) -> Result<SystemTime> {
        let mut tries = 0;
        loop {
            let probe = format!("{CLOCK_PREFIX}{}", crate::txn::new_save_id()?);
            self.put(&probe, b"", PutMode::Overwrite)?;
            let head = Storage::head(self, &probe);
            let _ = self.delete(&probe);
            tries += 1;
            match head? {
                Some(h) => return Ok(h.modified),
                None if tries < CLOCK_TRIES => continue,
                None => {
                    return Err(CoreError::io(
                        self.name(&probe),
                        std::io::Error::new(
                            std::io::ErrorKind::NotFound,
                            format!("the clock probe vanished {tries} times"),
                        ),
                    ))
                }
            }
        }
    }

    fn put_if(&self, rel: &str, bytes: &[u8], cond: PutIf<'_>) -> Result<Option<Version>> {
        self.put(rel, bytes, Self::mode(cond))
    }

    /// One conditional PUT: an object PUT is atomic.
    fn publish(
        &self,
        rel: &str,
        bytes: &[u8],
        cond: PutIf<'_>,
        ready: &dyn Fn() -> Result<()>,
    ) -> Result<Option<Version>> {
        ready()?;
        self.put(rel, bytes, Self::mode(cond))
    }

    /// A PUT of the same bytes conditional on `version` (an object's time cannot be set).
    fn touch_if(&self, rel: &str, bytes: &[u8], version: &Version) -> Result<Option<Version>> {
        self.put(rel, bytes, Self::mode(PutIf::Version(version)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_servers_failure_counts_for_the_breaker_never_its_answers() {
        let path = "k".to_string();
        let source = || -> Box<dyn std::error::Error + Send + Sync> { "x".into() };
        let answers = [
            object_store::Error::NotFound {
                path: path.clone(),
                source: source(),
            },
            object_store::Error::Precondition {
                path: path.clone(),
                source: source(),
            },
            object_store::Error::AlreadyExists {
                path,
                source: source(),
            },
        ];
        for e in answers {
            assert!(!e.server_failed(), "{e}");
            let core = CoreError::io("k", to_io(e));
            assert!(!core.server_failed(), "{core}");
        }
        let failed = object_store::Error::Generic {
            store: "S3",
            source: source(),
        };
        assert!(failed.server_failed());
        assert!(CoreError::io("k", to_io(failed)).server_failed());
        assert!(!CoreError::InvalidArgument("x".into()).server_failed());
        let timed_out = std::io::Error::unanswered(Duration::from_secs(1));
        assert!(timed_out.server_failed()); // (a cut request is not recorded: see block_on)
    }
}
