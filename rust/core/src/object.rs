//! Checkpoints in object stores (`s3://bucket/prefix` on S3 and S3-compatible servers,
//! `gs://bucket/prefix` on Google Cloud Storage), through Apache Arrow's `object_store`.
//!
//! [`ObjectStorage`] is a [`Storage`]: data objects are read with one ranged GET per unit the
//! reader asks for (the block-aligned units of `io.rs`, in parallel) and written as multipart
//! uploads whose parts go up, in parallel, as soon as the writers have filled them.
//! [`ObjectSaveTxn`] is the save transaction (docs/FORMAT.md, "Object stores"): a lease object
//! created with a conditional PUT, and the manifest as the commit, written last with a
//! conditional PUT so that of two saves racing to one prefix exactly one commits.
//!
//! Credentials, region and endpoint come from the standard environment variables
//! (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, ... or `GOOGLE_*`). Requests are retried with
//! backoff on throttling, 5xx and dropped connections, bounded in count and time
//! (`OLMO_CHUNKS_RETRY_TIMEOUT` seconds, default 120), then fail with an I/O error.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures_util::{StreamExt, TryStreamExt};
use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as ObjectPath;
use object_store::{
    BackoffConfig, GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig, UpdateVersion,
};
use tokio::runtime::Runtime;

use crate::error::{CoreError, Result};
use crate::manifest::{Manifest, MANIFEST_NAME};
use crate::storage::{HeadCheck, IoCounters, Object, Storage};
use crate::txn::{
    check_commit, is_data_file, is_save_id, new_save_id, owner_is_dead_here, owner_token,
    Heartbeat, SaveOptions, Transaction, DATA_DIR, LEASE_NAME, MAX_LEASE_LEN,
};

/// Parts of a multipart upload are this large (the last one smaller), or larger where a file
/// would otherwise need more than `MAX_PARTS`.
pub const PART_SIZE: u64 = 8 << 20;
/// S3's limit on the parts of one upload.
const MAX_PARTS: u64 = 10_000;

/// True if `location` is a URL (`scheme://...`) rather than a local path.
pub fn is_url(location: &str) -> bool {
    location.contains("://")
}

/// A bucket's client, shared by every storage in it, with the counters of what it moved.
struct Bucket {
    store: Arc<dyn ObjectStore>,
    multipart: Arc<dyn MultipartStore>,
    counters: Arc<IoCounters>,
}

/// The tokio runtime that drives the clients, and the clients by bucket URL. Both belong to one
/// process: a child forked from it (whose runtime threads did not survive the fork) starts afresh,
/// leaking the parent's rather than dropping what it cannot shut down.
struct Clients {
    pid: u32,
    runtime: Arc<Runtime>,
    buckets: HashMap<String, Arc<Bucket>>,
}

static CLIENTS: Mutex<Option<Clients>> = Mutex::new(None);

fn with_clients<T>(f: impl FnOnce(&mut Clients) -> Result<T>) -> Result<T> {
    let mut guard = CLIENTS.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    if !matches!(guard.as_ref(), Some(c) if c.pid == pid) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("olmo-chunks-object-store")
            .enable_all()
            .build()
            .map_err(|e| CoreError::io("tokio runtime", e))?;
        if let Some(stale) = guard.replace(Clients {
            pid,
            runtime: Arc::new(runtime),
            buckets: HashMap::new(),
        }) {
            std::mem::forget(stale);
        }
    }
    f(guard.as_mut().unwrap())
}

fn runtime() -> Result<Arc<Runtime>> {
    with_clients(|c| Ok(c.runtime.clone()))
}

/// The retry policy: backoff from 100 ms to 15 s, at most 10 retries and
/// `OLMO_CHUNKS_RETRY_TIMEOUT` seconds (default 120) from a request's first try.
fn retry_config() -> RetryConfig {
    let timeout = std::env::var("OLMO_CHUNKS_RETRY_TIMEOUT")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .unwrap_or(Duration::from_secs(120));
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
            base: 2.0,
        },
        max_retries: 10,
        retry_timeout: timeout,
    }
}

/// Splits `url` into its bucket URL (`s3://bucket`) and the key prefix below it.
fn split_url(url: &str) -> Result<(String, String, String)> {
    let bad = |why: &str| CoreError::InvalidArgument(format!("{url}: {why}"));
    let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("not a URL"))?;
    if !matches!(scheme, "s3" | "s3a" | "gs") {
        return Err(bad(
            "unsupported URL scheme (s3://bucket/prefix and gs://bucket/prefix are supported)",
        ));
    }
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(bad("no bucket name"));
    }
    let prefix = prefix.trim_end_matches('/');
    if prefix.split('/').any(|p| matches!(p, "." | "..")) {
        return Err(bad("'.' and '..' are not allowed in an object key prefix"));
    }
    Ok((scheme.to_string(), bucket.to_string(), prefix.to_string()))
}

fn bucket_for(scheme: &str, bucket: &str) -> Result<Arc<Bucket>> {
    let key = format!("{scheme}://{bucket}");
    with_clients(|c| {
        if let Some(b) = c.buckets.get(&key) {
            return Ok(b.clone());
        }
        let bad = |e: object_store::Error| CoreError::InvalidArgument(format!("{key}: {e}"));
        let b = if scheme == "gs" {
            let gcs = Arc::new(
                object_store::gcp::GoogleCloudStorageBuilder::from_env()
                    .with_bucket_name(bucket)
                    .with_retry(retry_config())
                    .build()
                    .map_err(bad)?,
            );
            Bucket {
                store: gcs.clone(),
                multipart: gcs,
                counters: Arc::default(),
            }
        } else {
            let s3 = Arc::new(
                object_store::aws::AmazonS3Builder::from_env()
                    .with_bucket_name(bucket)
                    .with_retry(retry_config())
                    .build()
                    .map_err(bad)?,
            );
            Bucket {
                store: s3.clone(),
                multipart: s3,
                counters: Arc::default(),
            }
        };
        let b = Arc::new(b);
        c.buckets.insert(key, b.clone());
        Ok(b)
    })
}

/// The counters of everything moved to and from the bucket `url` lies in, by this process.
pub fn bucket_counters(url: &str) -> Result<Arc<IoCounters>> {
    let (scheme, bucket, _) = split_url(url)?;
    Ok(bucket_for(&scheme, &bucket)?.counters.clone())
}

/// A prefix of a bucket, holding one checkpoint.
#[derive(Clone)]
pub struct ObjectStorage {
    bucket: Arc<Bucket>,
    runtime: Arc<Runtime>,
    /// `scheme://bucket/prefix`, for names in errors.
    url: String,
    prefix: String,
    /// Smallest part of a multipart upload.
    part_size: u64,
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

fn to_io(e: object_store::Error) -> std::io::Error {
    std::io::Error::new(io_kind(&e), e)
}

impl ObjectStorage {
    /// The storage at `url` (`s3://bucket/prefix` or `gs://bucket/prefix`).
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
        })
    }

    fn key(&self, rel: &str) -> ObjectPath {
        ObjectPath::from(if self.prefix.is_empty() {
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        })
    }

    /// Runs one request to completion from synchronous code.
    fn block_on<T>(&self, fut: impl std::future::Future<Output = T>) -> T {
        self.bucket
            .counters
            .requests
            .fetch_add(1, Ordering::Relaxed);
        self.runtime.block_on(fut)
    }

    fn err(&self, rel: &str, e: object_store::Error) -> CoreError {
        if is_missing_bucket(&e) {
            return self.missing_bucket();
        }
        CoreError::io(self.name(rel), to_io(e))
    }

    /// A missing bucket is a wrong location, not a missing checkpoint or data file.
    fn missing_bucket(&self) -> CoreError {
        let bucket = self.url.split('/').nth(2).unwrap_or_default();
        CoreError::InvalidArgument(format!(
            "{}: the bucket {bucket:?} does not exist at this endpoint (check the URL and \
             AWS_ENDPOINT_URL / AWS_REGION, or create the bucket)",
            self.url
        ))
    }

    /// Writes `bytes` to `rel` in `mode`; returns the new version.
    fn put(&self, rel: &str, bytes: Vec<u8>, mode: PutMode) -> Result<UpdateVersion> {
        let n = bytes.len() as u64;
        let opts = PutOptions {
            mode,
            ..Default::default()
        };
        let r = self
            .block_on(
                self.bucket
                    .store
                    .put_opts(&self.key(rel), PutPayload::from(bytes), opts),
            )
            .map_err(|e| self.put_err(rel, e))?;
        self.bucket.counters.add_written(n);
        Ok(UpdateVersion {
            e_tag: r.e_tag,
            version: r.version,
        })
    }

    fn put_err(&self, rel: &str, e: object_store::Error) -> CoreError {
        match e {
            object_store::Error::Precondition { .. } => CoreError::io(
                self.name(rel),
                std::io::Error::new(std::io::ErrorKind::AlreadyExists, e),
            ),
            e => self.err(rel, e),
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
    ) -> Result<Option<(Vec<u8>, UpdateVersion, Duration)>> {
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
        let Some((bytes, meta)) = got else {
            return Ok(None);
        };
        let age = SystemTime::now()
            .duration_since(meta.last_modified.into())
            .unwrap_or(Duration::ZERO);
        let v = UpdateVersion {
            e_tag: meta.e_tag,
            version: meta.version,
        };
        Ok(Some((bytes, v, age)))
    }

    /// [`Self::get_versioned`] of the lease: refused, unread, if larger than a lease can be.
    fn get_lease(&self) -> Result<Option<(Vec<u8>, UpdateVersion, Duration)>> {
        self.get_versioned(LEASE_NAME, 0, &|_, size| {
            if size <= MAX_LEASE_LEN {
                return Ok(());
            }
            Err(CoreError::InvalidArgument(format!(
                "{}: {size} bytes, not an olmo-chunks lease (at most {MAX_LEASE_LEN}); refusing \
                 to save there",
                self.name(LEASE_NAME).display()
            )))
        })
    }

    /// The version of `rel`, or `None` if it does not exist.
    fn head(&self, rel: &str) -> Result<Option<UpdateVersion>> {
        match self.block_on(self.bucket.store.head(&self.key(rel))) {
            Ok(meta) => Ok(Some(UpdateVersion {
                e_tag: meta.e_tag,
                version: meta.version,
            })),
            Err(e @ object_store::Error::NotFound { .. }) if !is_missing_bucket(&e) => Ok(None),
            Err(e) => Err(self.err(rel, e)),
        }
    }

    /// Every object below the prefix, relative to it.
    fn list(&self, rel: &str) -> Result<Vec<String>> {
        let base = self.key(rel);
        let base = (!base.as_ref().is_empty()).then_some(&base);
        let metas: Vec<_> = self
            .block_on(self.bucket.store.list(base).try_collect::<Vec<_>>())
            .map_err(|e| self.err(rel, e))?;
        let strip = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        Ok(metas
            .into_iter()
            .filter_map(|m| Some(m.location.as_ref().strip_prefix(&strip)?.to_string()))
            .collect())
    }

    fn delete(&self, rel: &str) -> Result<()> {
        match self.block_on(self.bucket.store.delete(&self.key(rel))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.err(rel, e)),
        }
    }
}

impl Storage for ObjectStorage {
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
            Some((bytes, _, _)) => Ok(bytes),
            None => Err(CoreError::io(
                self.name(rel),
                std::io::Error::new(std::io::ErrorKind::NotFound, "no such object"),
            )),
        }
    }

    /// Refuses an object that exists: data objects are written once, under a fresh save id, so
    /// one that exists means a reused save id, whose live data must not be overwritten.
    fn create(&self, rel: &str, size: u64) -> Result<Box<dyn Object>> {
        if self.head(rel)?.is_some() {
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
        let upload = if size > part {
            let id = self
                .block_on(self.bucket.multipart.create_multipart(&key))
                .map_err(|e| self.err(rel, e))?;
            Some(id)
        } else {
            None
        };
        let parts = size.div_ceil(part).max(1);
        Ok(Box::new(RemoteWriter {
            storage: self.clone(),
            key,
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
}

struct RemoteReader {
    storage: ObjectStorage,
    key: ObjectPath,
    size: u64,
}

impl Object for RemoteReader {
    fn size(&self) -> u64 {
        self.size
    }

    /// One ranged GET, its body copied into `bufs` as it arrives.
    fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        let len: u64 = bufs.iter().map(|b| b.len() as u64).sum();
        if len == 0 {
            return Ok(());
        }
        if offset + len > self.size {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let s = &self.storage;
        let opts = GetOptions {
            range: Some(GetRange::Bounded(offset..offset + len)),
            ..Default::default()
        };
        let mut bufs = bufs.iter_mut().map(|b| &mut **b).filter(|b| !b.is_empty());
        let mut cur: &mut [u8] = bufs.next().unwrap_or_default();
        s.block_on(async {
            let mut body = s
                .bucket
                .store
                .get_opts(&self.key, opts)
                .await?
                .into_stream();
            while let Some(piece) = body.next().await {
                let mut piece = &piece?[..];
                while !piece.is_empty() {
                    if cur.is_empty() {
                        cur = bufs
                            .next()
                            .ok_or_else(|| std::io::Error::other("long read"))?;
                    }
                    let n = piece.len().min(cur.len());
                    let (head, tail) = std::mem::take(&mut cur).split_at_mut(n);
                    head.copy_from_slice(&piece[..n]);
                    cur = tail;
                    piece = &piece[n..];
                    s.bucket.counters.add_read(n as u64);
                }
            }
            Ok::<_, std::io::Error>(())
        })
        .map_err(|e| match e.downcast::<object_store::Error>() {
            Ok(e) => to_io(e),
            Err(e) => e,
        })?;
        if !cur.is_empty() || bufs.next().is_some() {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }

    fn write_all_at(&self, _data: &[u8], _offset: u64) -> std::io::Result<()> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    fn sync(&self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A part of an upload being filled: its bytes, how many are filled, and its id once uploaded.
#[derive(Default)]
struct Part {
    buf: Vec<u8>,
    filled: u64,
    uploaded: Option<PartId>,
}

/// A data object being written: parts of `part` bytes filled by the writers and uploaded by the
/// writer that completes each (a file of one part is uploaded whole by `sync`).
struct RemoteWriter {
    storage: ObjectStorage,
    key: ObjectPath,
    size: u64,
    part: u64,
    /// The multipart upload, until it completes or is aborted.
    upload: Mutex<Option<String>>,
    parts: Vec<Mutex<Part>>,
}

impl RemoteWriter {
    fn part_len(&self, k: usize) -> u64 {
        (self.size - k as u64 * self.part).min(self.part)
    }

    /// Fills `offset..offset + len` with `data` (zeros if `None`), uploading each part it
    /// completes.
    fn fill(&self, mut offset: u64, len: u64, mut data: Option<&[u8]>) -> std::io::Result<()> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.size)
            .ok_or_else(|| std::io::Error::other("write past the end of the object"))?;
        while offset < end {
            let k = (offset / self.part) as usize;
            let (start, plen) = (k as u64 * self.part, self.part_len(k));
            let n = (end - offset).min(start + plen - offset);
            let mut p = self.parts[k].lock().unwrap();
            if p.buf.is_empty() {
                p.buf = vec![0; plen as usize];
            }
            if let Some(d) = data {
                let at = (offset - start) as usize;
                p.buf[at..at + n as usize].copy_from_slice(&d[..n as usize]);
                data = Some(&d[n as usize..]);
            }
            p.filled += n;
            if p.filled == plen && self.parts.len() > 1 {
                self.upload_part(k, &mut p)?;
            }
            offset += n;
        }
        Ok(())
    }

    fn upload_part(&self, k: usize, p: &mut Part) -> std::io::Result<()> {
        let id = self.upload.lock().unwrap().clone();
        let Some(id) = id else {
            return Err(std::io::Error::other("the upload was abandoned"));
        };
        let s = &self.storage;
        let bytes = std::mem::take(&mut p.buf);
        let n = bytes.len() as u64;
        let part = s
            .block_on(
                s.bucket
                    .multipart
                    .put_part(&self.key, &id, k, PutPayload::from(bytes)),
            )
            .map_err(to_io)?;
        s.bucket.counters.add_written(n);
        p.uploaded = Some(part);
        Ok(())
    }
}

impl Object for RemoteWriter {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, _bufs: &mut [&mut [u8]], _offset: u64) -> std::io::Result<()> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    fn write_all_at(&self, data: &[u8], offset: u64) -> std::io::Result<()> {
        self.fill(offset, data.len() as u64, Some(data))
    }

    fn pad(&self, offset: u64, len: u64) -> std::io::Result<()> {
        self.fill(offset, len, None)
    }

    /// Uploads what is left (bytes never written are zeros) and completes the object.
    fn sync(&self) -> std::io::Result<()> {
        let s = &self.storage;
        let id = self.upload.lock().unwrap().clone();
        let Some(id) = id else {
            let mut p = self.parts[0].lock().unwrap();
            let mut bytes = std::mem::take(&mut p.buf);
            bytes.resize(self.size as usize, 0);
            let n = bytes.len() as u64;
            s.block_on(s.bucket.store.put(&self.key, PutPayload::from(bytes)))
                .map_err(to_io)?;
            s.bucket.counters.add_written(n);
            return Ok(());
        };
        let mut ids = Vec::with_capacity(self.parts.len());
        for (k, p) in self.parts.iter().enumerate() {
            let mut p = p.lock().unwrap();
            if p.uploaded.is_none() {
                if p.buf.is_empty() {
                    p.buf = vec![0; self.part_len(k) as usize];
                }
                self.upload_part(k, &mut p)?;
            }
            ids.push(p.uploaded.clone().unwrap());
        }
        s.block_on(s.bucket.multipart.complete_multipart(&self.key, &id, ids))
            .map_err(to_io)?;
        *self.upload.lock().unwrap() = None;
        Ok(())
    }
}

impl Drop for RemoteWriter {
    /// Abandons an upload that never completed (best effort: a bucket lifecycle rule reclaims
    /// what a killed writer leaves).
    fn drop(&mut self) {
        if let Some(id) = self.upload.lock().unwrap().take() {
            let s = &self.storage;
            let _ = s.block_on(s.bucket.multipart.abort_multipart(&self.key, &id));
        }
    }
}

/// Renews the lease object holding `token` with a conditional PUT over the version last written;
/// false once another writer replaced or removed it.
fn renew_lease_object(storage: &ObjectStorage, token: &str, version: &mut UpdateVersion) -> bool {
    let mode = PutMode::Update(version.clone());
    match storage.put(LEASE_NAME, token.as_bytes().to_vec(), mode) {
        Ok(v) => *version = v,
        Err(CoreError::Io { source, .. })
            if source.kind() == std::io::ErrorKind::AlreadyExists
                || source.kind() == std::io::ErrorKind::NotFound =>
        {
            return false;
        }
        Err(_) => {} // tried again next beat
    }
    true
}

/// One save into a prefix of an object store, from the lease to the commit (or the abort).
pub struct ObjectSaveTxn {
    storage: ObjectStorage,
    save_id: String,
    token: String,
    /// The committed manifest's version when the save began (`None`: there was none).
    replaces: Option<UpdateVersion>,
    heartbeat: Heartbeat,
    finished: bool,
}

impl ObjectSaveTxn {
    /// Takes the prefix's lease and checks what is there, as `SaveTxn::begin` does for a
    /// directory: refuses a prefix holding anything an olmo-chunks save did not write, a
    /// committed checkpoint unless `overwrite`, and a lease held by a live writer; removes the
    /// data failed saves left.
    pub fn begin(url: &str, opts: SaveOptions) -> Result<Self> {
        let storage = ObjectStorage::open(url)?;
        let save_id = new_save_id()?;
        let token = owner_token(&save_id);
        let version = acquire(&storage, &token, opts.lease_timeout)?;
        let every = (opts.lease_timeout / 4).max(Duration::from_millis(100));
        let mut txn = ObjectSaveTxn {
            heartbeat: {
                let (storage, token, mut version) = (storage.clone(), token.clone(), version);
                Heartbeat::start(every, move || {
                    renew_lease_object(&storage, &token, &mut version)
                })
            },
            storage,
            save_id,
            token,
            replaces: None,
            finished: false,
        };
        txn.prepare(opts.overwrite)?;
        Ok(txn)
    }

    fn prepare(&mut self, overwrite: bool) -> Result<()> {
        let s = &self.storage;
        self.replaces = s.head(MANIFEST_NAME)?;
        let committed = self.replaces.is_some();
        if committed && !overwrite {
            return Err(CoreError::Exists { path: s.name("") });
        }
        let mut foreign = Vec::new();
        let mut saves: Vec<(String, String)> = Vec::new();
        for rel in s.list("")? {
            if let Some(rest) = rel.strip_prefix(&format!("{DATA_DIR}/")) {
                match rest.split_once('/') {
                    Some((id, file)) if is_save_id(id) && is_data_file(file) => {
                        saves.push((id.to_string(), rel.clone()))
                    }
                    _ => foreign.push(rel),
                }
            }
        }
        if !foreign.is_empty() {
            foreign.sort();
            return Err(CoreError::InvalidArgument(format!(
                "{}: refusing to save there: its data/ holds objects this store did not write (found {}); \
                 nothing was changed",
                s.url,
                foreign.join(", ")
            )));
        }
        // What failed saves left: data no committed manifest names. If the manifest cannot be
        // read, keep all data (it may be what it names).
        let live = if committed {
            Manifest::open_from(s)
                .ok()
                .map(|m| m.files.iter().map(|f| f.path.clone()).collect::<Vec<_>>())
        } else {
            Some(Vec::new())
        };
        if let Some(live) = live {
            for (_, rel) in saves.iter().filter(|(_, rel)| !live.contains(rel)) {
                s.delete(rel)?;
            }
        }
        Ok(())
    }

    /// Removes the data of every save `doomed` selects. Best effort.
    fn remove_saves(&self, doomed: impl Fn(&str) -> bool) {
        let Ok(rels) = self.storage.list(DATA_DIR) else {
            return;
        };
        for rel in rels {
            let id = rel
                .strip_prefix(&format!("{DATA_DIR}/"))
                .and_then(|r| r.split_once('/'));
            if id.is_some_and(|(id, file)| is_save_id(id) && is_data_file(file) && doomed(id)) {
                let _ = self.storage.delete(&rel);
            }
        }
    }

    fn check_lease(&self) -> Result<()> {
        let ours = self
            .storage
            .get_lease()?
            .is_some_and(|(t, _, _)| t == self.token.as_bytes());
        if ours && !self.heartbeat.lost.load(Ordering::Relaxed) {
            return Ok(());
        }
        Err(CoreError::Locked {
            path: self.storage.name(""),
            reason: "this save's lease was taken over by another writer (its heartbeat stalled \
                     past the lease timeout); nothing was committed"
                .into(),
        })
    }

    fn release(&mut self) {
        self.heartbeat.stop();
        let ours = self
            .storage
            .get_lease()
            .is_ok_and(|l| l.is_some_and(|(t, _, _)| t == self.token.as_bytes()));
        if ours {
            let _ = self.storage.delete(LEASE_NAME);
        }
    }
}

impl Transaction for ObjectSaveTxn {
    fn save_id(&self) -> &str {
        &self.save_id
    }

    fn name(&self, rel: &str) -> PathBuf {
        self.storage.name(rel)
    }

    /// Writes the manifest with a conditional PUT: it must still be absent, or still be the
    /// version this save saw at its start. A save that loses that race commits nothing.
    fn commit(&mut self, m: &Manifest) -> Result<()> {
        if self.finished {
            return Err(CoreError::InvalidArgument(
                "this save transaction has already ended".into(),
            ));
        }
        check_commit(m, &self.save_id)?;
        self.check_lease()?;
        let mode = match &self.replaces {
            Some(v) => PutMode::Update(v.clone()),
            None => PutMode::Create,
        };
        match self.storage.put(MANIFEST_NAME, m.encode(), mode) {
            Ok(_) => {}
            Err(CoreError::Io { source, .. })
                if source.kind() == std::io::ErrorKind::AlreadyExists =>
            {
                return Err(CoreError::Locked {
                    path: self.storage.name(""),
                    reason: "another save committed a checkpoint here while this one ran; \
                             nothing was committed"
                        .into(),
                })
            }
            Err(e) => return Err(e),
        }
        self.finished = true;
        let id = self.save_id.clone();
        self.remove_saves(|other| other != id);
        self.release();
        Ok(())
    }

    fn abort(&mut self) {
        if self.finished {
            return;
        }
        self.finished = true;
        let id = self.save_id.clone();
        self.remove_saves(|other| other == id);
        self.release();
    }
}

impl Drop for ObjectSaveTxn {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Creates the lease object (a conditional PUT: only if absent), taking it over from a dead writer
/// (no heartbeat for `timeout`, or a local process that no longer exists) with a PUT conditional on
/// the version that writer left. Returns the lease's version.
fn acquire(s: &ObjectStorage, token: &str, timeout: Duration) -> Result<UpdateVersion> {
    let exists = |e: &CoreError| matches!(e, CoreError::Io { source, .. } if source.kind() == std::io::ErrorKind::AlreadyExists);
    for _ in 0..3 {
        match s.put(LEASE_NAME, token.as_bytes().to_vec(), PutMode::Create) {
            Ok(v) => return Ok(v),
            Err(e) if exists(&e) => {}
            Err(e) => return Err(e),
        }
        let Some((held, version, age)) = s.get_lease()? else {
            continue;
        };
        let held = String::from_utf8_lossy(&held).into_owned();
        if age <= timeout && !owner_is_dead_here(&held) {
            return Err(CoreError::Locked {
                path: s.name(""),
                reason: format!(
                    "another save holds its lease ({held}, heartbeat {}s ago); a lease without a \
                     heartbeat for {}s belongs to a dead writer and is taken over",
                    age.as_secs(),
                    timeout.as_secs()
                ),
            });
        }
        match s.put(
            LEASE_NAME,
            token.as_bytes().to_vec(),
            PutMode::Update(version),
        ) {
            Ok(v) => return Ok(v),
            Err(e) if exists(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Err(CoreError::Locked {
        path: s.name(""),
        reason: "could not take the save lease (contended)".into(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{read_from, write_chunks, write_chunks_to, ByteCopy, WriteItem};
    use proptest::prelude::*;

    /// A prefix of an in-memory store (which takes parts of any size), uploading in `part` bytes.
    fn in_memory(part: u64) -> ObjectStorage {
        let mem = Arc::new(object_store::memory::InMemory::new());
        ObjectStorage {
            bucket: Arc::new(Bucket {
                store: mem.clone(),
                multipart: mem,
                counters: Arc::default(),
            }),
            runtime: runtime().unwrap(),
            url: "memory://b/p".into(),
            prefix: "p".into(),
            part_size: part,
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        /// Objects written in parts (any part size, block size, item sizes and files) hold the
        /// same bytes as the files a local write makes, and read back through ranged GETs.
        #[test]
        fn uploads_in_parts_equal_local_files(
            sizes in prop::collection::vec((0usize..2, 0usize..700), 0..8),
            part in prop::sample::select(vec![1u64, 64, 100, 1000, 1 << 20]),
            block in prop::sample::select(vec![1u64, 64, 100, 4096]),
        ) {
            let data: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &(_, n))| (0..n).map(|j| (i * 31 + j * 7) as u8 | 1).collect())
                .collect();
            let items: Vec<WriteItem<'_>> = sizes
                .iter()
                .zip(&data)
                .map(|(&(file, _), d)| WriteItem { file, data: d })
                .collect();
            let rels = vec!["data/a/rank-00000.bin".to_string(), "data/a/rank-00001.bin".to_string()];
            let dir = tempfile::tempdir().unwrap();
            let (w_local, f_local) = write_chunks(dir.path(), &rels, &items, block, 3).unwrap();
            let store = in_memory(part);
            let (w_obj, f_obj) = write_chunks_to(&store, &rels, &items, block, 3).unwrap();
            prop_assert_eq!(&w_local, &w_obj);
            prop_assert_eq!(&f_local, &f_obj);
            for rel in &rels {
                let local = std::fs::read(dir.path().join(rel)).unwrap();
                prop_assert_eq!(local, store.get(rel).unwrap());
            }
            // Every non-empty chunk back through the reader, its checksums verified.
            let keep: Vec<usize> = (0..data.len()).filter(|&i| !data[i].is_empty()).collect();
            let raw = |s: &str| serde_json::value::RawValue::from_string(s.into()).unwrap();
            let m = crate::save::assemble_manifest(
                &"a".repeat(32),
                block,
                keep.iter()
                    .map(|&i| crate::save::TensorSchema {
                        key: format!("t{i}"),
                        dtype: "uint8".into(),
                        shape: vec![data[i].len() as u64],
                        role: "tensor".into(),
                    })
                    .collect(),
                keep.iter()
                    .map(|&i| {
                        let w = &w_obj[i];
                        crate::save::SavedChunk {
                            key: format!("t{i}"),
                            region: crate::region::Region::Flat { start: 0, len: w.len },
                            file: rels[w.file as usize].clone(),
                            file_size: f_obj[w.file as usize].size,
                            offset: w.offset,
                            len: w.len,
                            checksums: w.checksums.clone(),
                            codec: w.codec,
                            block_lens: w.block_lens.clone(),
                        }
                    })
                    .collect(),
                raw("{}"),
                raw("{}"),
            )
            .unwrap();
            let mut out: Vec<Vec<u8>> = data.iter().map(|d| vec![0; d.len()]).collect();
            let copies = keep
                .iter()
                .enumerate()
                .map(|(t, &i)| ByteCopy {
                    chunk: m.chunk_start[t],
                    src: 0,
                    dst: i,
                    dst_off: 0,
                    len: data[i].len() as u64,
                })
                .collect();
            let dests = out.iter_mut().map(|v| &mut v[..]).collect();
            read_from(&store, &m, copies, dests, true, 3).unwrap();
            prop_assert_eq!(out, data);
        }
    }

    #[test]
    fn urls() {
        assert!(is_url("s3://b/x") && !is_url("/tmp/x"));
        let s = |u: &str| split_url(u).map(|(a, b, c)| format!("{a}|{b}|{c}"));
        assert_eq!(s("s3://b/x/y/").unwrap(), "s3|b|x/y");
        assert_eq!(s("gs://b").unwrap(), "gs|b|");
        assert!(s("s3:///x").is_err());
        assert!(s("s3://b/../x").is_err());
        assert!(s("ftp://b/x").is_err());
    }
}
