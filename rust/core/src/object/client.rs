//! The clients of the buckets this process reaches, and the runtime that drives them.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Once};
use std::time::{Duration, Instant};

use object_store::aws::AmazonS3ConfigKey;
use object_store::gcp::GoogleConfigKey;
use object_store::multipart::MultipartStore;
use object_store::{BackoffConfig, ClientConfigKey, ObjectStore, RetryConfig};
use tokio::runtime::Runtime;

use crate::error::{CoreError, Result};
use crate::storage::IoCounters;

/// A bucket's client, shared by every storage in it, with the counters of what it moved.
pub(super) struct Bucket {
    pub(super) store: Arc<dyn ObjectStore>,
    pub(super) multipart: Arc<dyn MultipartStore>,
    pub(super) counters: Arc<IoCounters>,
    pub(super) breaker: Breaker,
}

/// The most a request may take when it begins within a retry budget of another request's slow
/// failure (see [`Breaker`]).
const AFTER_FAILURE: Duration = Duration::from_secs(1);

/// Bounds what follows a request that failed slowly, its retries run out: the server is gone or
/// hung. Each request begun within one retry budget of that failure gets [`AFTER_FAILURE`] (or the
/// budget, if less) instead of a budget of its own, so the best-effort cleanup of the failed
/// operation (aborting its upload, listing and removing its files, releasing its lease: 4 to 5
/// requests) ends within seconds instead of a budget each (a save failed 20.7-29.2 s after its
/// server died at a 10 s budget; now 6.9-9.0 s). A request that succeeds, or the budget's passing,
/// ends this. The requests of an operation begun in that time are small ones first (manifest,
/// lease), which a live server answers well within it.
pub(super) struct Breaker {
    budget: Duration,
    failed_at: Mutex<Option<Instant>>,
}

impl Breaker {
    pub(super) fn new(budget: Duration) -> Self {
        Breaker {
            budget,
            failed_at: Mutex::new(None),
        }
    }

    /// The deadline of a request begun now: `None` for the client's own (the budget), as inside
    /// [`with_full_budget`].
    pub(super) fn deadline(&self) -> Option<Duration> {
        if FULL_BUDGET.get() {
            return None;
        }
        let failed = *self.failed_at.lock().unwrap_or_else(|p| p.into_inner());
        failed
            .filter(|t| t.elapsed() < self.budget)
            .map(|_| AFTER_FAILURE.min(self.budget))
    }

    /// Notes how a request begun at `start` ended: `ok`, or whether the server `failed` (not an
    /// answer such as a 404, however slow). A failure counts if it took a second or half the
    /// budget: retries ran out (a refused connection with retries left is retried, not failed).
    pub(super) fn record(&self, start: Instant, failed: bool, ok: bool) {
        let mut failed_at = self.failed_at.lock().unwrap_or_else(|p| p.into_inner());
        if ok {
            *failed_at = None;
        } else if failed && start.elapsed() >= (self.budget / 2).min(Duration::from_secs(1)) {
            *failed_at = Some(Instant::now());
        }
    }
}

thread_local! {
    static FULL_BUDGET: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with each request this thread makes given its full budget, whatever failed before:
/// for a request whose answer decides what is kept (did the manifest commit?), never cut short.
pub(crate) fn with_full_budget<T>(f: impl FnOnce() -> T) -> T {
    let before = FULL_BUDGET.replace(true);
    let out = f();
    FULL_BUDGET.set(before);
    out
}

/// The tokio runtime that drives the clients, and the clients by bucket URL, each with the
/// fingerprint of the settings it was made from (`settings_fingerprint`). Both belong to one
/// process: a child forked from it (whose runtime threads did not survive the fork) starts afresh,
/// leaking the parent's rather than dropping what it cannot shut down.
struct Clients {
    pid: u32,
    runtime: Arc<Runtime>,
    buckets: HashMap<String, (u64, Arc<Bucket>)>,
}

/// A hash of the environment a bucket's client is made from (`AWS_*` or `GOOGLE_*`, and
/// `OLMO_CHUNKS_RETRY_TIMEOUT`): a process that changes them (a fixed endpoint or key in a
/// notebook) gets a client of the new settings, where the first ones were kept for good.
fn settings_fingerprint(scheme: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let prefix = if scheme == "gs" { "GOOGLE_" } else { "AWS_" };
    let mut vars: Vec<(String, String)> = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.to_string_lossy().into_owned())))
        .filter(|(k, _)| k.starts_with(prefix) || k == "OLMO_CHUNKS_RETRY_TIMEOUT")
        .collect();
    vars.sort();
    let mut h = std::collections::hash_map::DefaultHasher::new();
    vars.hash(&mut h);
    h.finish()
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

pub(super) fn runtime() -> Result<Arc<Runtime>> {
    with_clients(|c| Ok(c.runtime.clone()))
}

/// `OLMO_CHUNKS_RETRY_TIMEOUT` seconds (default 120): how long one operation may take, retries
/// included.
pub(super) fn retry_budget() -> Result<Duration> {
    let Ok(v) = std::env::var("OLMO_CHUNKS_RETRY_TIMEOUT") else {
        return Ok(Duration::from_secs(120));
    };
    v.trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            CoreError::InvalidArgument(format!(
                "OLMO_CHUNKS_RETRY_TIMEOUT={v:?}: expected a number of seconds above 0"
            ))
        })
}

/// Refuses an endpoint the client would only reject when it sends a request, with a panic of its
/// HTTP library or "HTTP error: builder error": one that is not an http(s) URL with a host (a
/// blank, a bad port) and neither query nor fragment (requests to it failed with "ETag Header
/// missing from response"), or an `http://` one without `AWS_ALLOW_HTTP=true`. The endpoint is the one
/// the client uses: `AWS_ENDPOINT_URL_S3`, else `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT`).
fn check_endpoint(builder: &object_store::aws::AmazonS3Builder) -> Result<()> {
    let value = |key| builder.get_config_value(&key);
    let (var, endpoint) = match (
        value(AmazonS3ConfigKey::S3Endpoint),
        value(AmazonS3ConfigKey::Endpoint),
    ) {
        (Some(v), _) => ("AWS_ENDPOINT_URL_S3", v),
        (None, Some(v)) => {
            let set = |var| std::env::var(var).is_ok_and(|x| x == v);
            (
                if set("AWS_ENDPOINT") && !set("AWS_ENDPOINT_URL") {
                    "AWS_ENDPOINT"
                } else {
                    "AWS_ENDPOINT_URL"
                },
                v,
            )
        }
        (None, None) => return Ok(()),
    };
    let parsed = url::Url::parse(&endpoint).ok().filter(|u| {
        matches!(u.scheme(), "http" | "https")
            && u.host_str().is_some_and(|h| !h.is_empty())
            && u.query().is_none()
            && u.fragment().is_none()
            && !endpoint
                .chars()
                .any(|c| c.is_whitespace() || c.is_control())
    });
    let Some(parsed) = parsed else {
        return Err(CoreError::InvalidArgument(format!(
            "{var}={endpoint:?} is not a valid URL (http://host:port or https://...)"
        )));
    };
    let allowed = value(AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
        .unwrap_or_default()
        .to_ascii_lowercase();
    if parsed.scheme() == "http" && !matches!(allowed.as_str(), "1" | "true" | "on" | "yes" | "y") {
        return Err(CoreError::InvalidArgument(format!(
            "the S3 endpoint {endpoint:?} ({var}) is plain HTTP; set AWS_ALLOW_HTTP=true to use it ({})",
            match std::env::var("AWS_ALLOW_HTTP") {
                Ok(v) => format!("AWS_ALLOW_HTTP is {v:?}"),
                Err(_) => "AWS_ALLOW_HTTP is not set".into(),
            }
        )));
    }
    Ok(())
}

thread_local! {
    /// Whether a panic on this thread is caught by [`no_panic`], which reports it itself.
    static CAUGHT: Cell<bool> = const { Cell::new(false) };
}

/// `f()`, or where the object store's client panics in it (on settings its HTTP library rejects
/// only when it builds a request: a region or key with a blank or a control character, a
/// credential URL that does not parse, a non-ASCII host), `InvalidArgumentError` saying so. Such a
/// panic prints nothing (the error says it all); any other panic reaches the hook it had before.
pub(super) fn no_panic<T>(f: impl FnOnce() -> T) -> Result<T> {
    static QUIET_HOOK: Once = Once::new();
    QUIET_HOOK.call_once(|| {
        let before = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !CAUGHT.with(Cell::get) {
                before(info)
            }
        }));
    });
    let outer = CAUGHT.with(|c| c.replace(true));
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CAUGHT.with(|c| c.set(outer));
    out.map_err(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        CoreError::InvalidArgument(format!(
            "the object store's client refused its settings ({why}): check the AWS_* or \
             GOOGLE_* variables and the URL"
        ))
    })
}

/// The retry policy: backoff from 100 ms to 15 s, at most 10 retries, no retry begun after the
/// budget from a request's first try.
fn retry_config(budget: Duration) -> RetryConfig {
    RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(15),
            base: 2.0,
        },
        max_retries: 10,
        retry_timeout: budget,
    }
}

/// The deadlines of one request, from the budget: connecting at most `min(budget, 5 s)`, the whole
/// request at most the budget, and no more than that between two reads of a body. So a server
/// that accepts and never answers, or stalls mid-body, fails its request by the budget, and the
/// retry policy begins no retry after it: an operation ends within about one budget, never
/// waiting on a client default (30 s a try) times the retries.
fn deadlines(budget: Duration) -> [(ClientConfigKey, String); 3] {
    let secs = |d: Duration| format!("{}ms", d.as_millis().max(1));
    [
        (
            ClientConfigKey::ConnectTimeout,
            secs(budget.min(Duration::from_secs(5))),
        ),
        (ClientConfigKey::Timeout, secs(budget)),
        (ClientConfigKey::ReadTimeout, secs(budget)),
    ]
}

/// Splits `url` into its bucket URL (`s3://bucket`) and the key prefix below it.
pub(super) fn split_url(url: &str) -> Result<(String, String, String)> {
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
    if !bucket
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
    {
        return Err(bad(
            "a bucket name holds only letters, digits, '-', '.' and '_'",
        ));
    }
    // Empty segments (`a//b`, a trailing `/`) collapse, as they always did.
    let prefix: Vec<&str> = prefix.split('/').filter(|p| !p.is_empty()).collect();
    if prefix.iter().any(|p| matches!(*p, "." | "..")) {
        return Err(bad("'.' and '..' are not allowed in an object key prefix"));
    }
    if prefix.iter().any(|p| p.chars().any(char::is_control)) {
        return Err(bad(
            "control characters are not allowed in an object key prefix",
        ));
    }
    Ok((scheme.to_string(), bucket.to_string(), prefix.join("/")))
}

pub(super) fn bucket_for(scheme: &str, bucket: &str) -> Result<Arc<Bucket>> {
    let key = format!("{scheme}://{bucket}");
    let settings = settings_fingerprint(scheme);
    with_clients(|c| {
        if let Some((made_from, b)) = c.buckets.get(&key) {
            if *made_from == settings {
                return Ok(b.clone());
            }
        }
        let bad = |e: object_store::Error| CoreError::InvalidArgument(format!("{key}: {e}"));
        let budget = retry_budget()?;
        let b = if scheme == "gs" {
            let mut builder = object_store::gcp::GoogleCloudStorageBuilder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry_config(budget));
            for (key, value) in deadlines(budget) {
                builder = builder.with_config(GoogleConfigKey::Client(key), value);
            }
            let gcs = Arc::new(no_panic(|| builder.build())?.map_err(bad)?);
            Bucket {
                store: gcs.clone(),
                multipart: gcs,
                counters: Arc::default(),
                breaker: Breaker::new(budget),
            }
        } else {
            let mut builder = object_store::aws::AmazonS3Builder::from_env()
                .with_bucket_name(bucket)
                .with_retry(retry_config(budget));
            for (key, value) in deadlines(budget) {
                builder = builder.with_config(AmazonS3ConfigKey::Client(key), value);
            }
            check_endpoint(&builder)?;
            let s3 = Arc::new(no_panic(|| builder.build())?.map_err(bad)?);
            Bucket {
                store: s3.clone(),
                multipart: s3,
                counters: Arc::default(),
                breaker: Breaker::new(budget),
            }
        };
        let b = Arc::new(b);
        c.buckets.insert(key, (settings, b.clone()));
        Ok(b)
    })
}

/// Drops `bucket`'s client from this process's cache: the next storage in it makes another, from
/// the settings then.
pub(super) fn forget(bucket: &Arc<Bucket>) {
    let _ = with_clients(|c| {
        c.buckets.retain(|_, (_, b)| !Arc::ptr_eq(b, bucket));
        Ok(())
    });
}

/// The counters of everything moved to and from the bucket `url` lies in, by this process.
pub fn bucket_counters(url: &str) -> Result<Arc<IoCounters>> {
    let (scheme, bucket, _) = split_url(url)?;
    Ok(bucket_for(&scheme, &bucket)?.counters.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_bounds_the_requests_after_a_slow_failure_until_a_success() {
        let b = Breaker::new(Duration::from_secs(10));
        let ago = |s: u64| Instant::now() - Duration::from_secs(s);
        assert_eq!(b.deadline(), None);
        b.record(Instant::now(), true, false); // refused at once: no retries ran
        assert_eq!(b.deadline(), None);
        b.record(ago(3), false, false); // a slow answer (a 404): the server did not fail
        assert_eq!(b.deadline(), None);
        b.record(ago(3), true, false); // its retries ran out
        assert_eq!(b.deadline(), Some(AFTER_FAILURE));
        assert_eq!(with_full_budget(|| b.deadline()), None);
        assert_eq!(b.deadline(), Some(AFTER_FAILURE));
        b.record(ago(3), false, true);
        assert_eq!(b.deadline(), None);
        let small = Breaker::new(Duration::from_millis(300));
        small.record(ago(1), true, false);
        assert_eq!(small.deadline(), Some(Duration::from_millis(300))); // never more than the budget
        std::thread::sleep(Duration::from_millis(310));
        assert_eq!(small.deadline(), None); // a budget after the failure
    }
}
