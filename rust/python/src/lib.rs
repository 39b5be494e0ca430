//! Python bindings for the olmo-chunks core. Thin on purpose: convert arguments, release the GIL
//! around the work, map errors onto the `olmo_chunks.errors` hierarchy.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use olmo_chunks_core as core;
use olmo_chunks_core::{CoreError, Manifest, Piece, Region, Storage};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

mod records;
use records::{
    region_py, PyBox, PyFlat, PyOverlap, PyPiece, PyRates, PyReadChoice, PyRoundBytes, PyRun,
    PyTarget, PyWriteItem, RegionArg,
};

/// Maps a core error onto the Python exception hierarchy in `olmo_chunks.errors`.
fn to_pyerr(py: Python<'_>, e: CoreError) -> PyErr {
    let msg = core::error::shown(&e.to_string());
    let (class, os): (&str, Option<(i32, String)>) = match &e {
        CoreError::Io { path, source } => {
            let class = match source.kind() {
                std::io::ErrorKind::NotFound => "MissingDataFileError",
                _ => "StorageError",
            };
            // An object store's errors carry no errno: the message alone says what happened.
            let os = source.raw_os_error();
            (class, os.map(|errno| (errno, path.display().to_string())))
        }
        CoreError::NotACheckpoint { .. } => ("CheckpointNotFoundError", None),
        CoreError::CorruptManifest { .. } => ("CorruptManifestError", None),
        CoreError::UnsupportedVersion { .. } => ("UnsupportedFormatError", None),
        CoreError::ChecksumMismatch { .. } => ("ChecksumError", None),
        CoreError::CorruptData { .. } => ("CorruptCheckpointError", None),
        CoreError::Truncated { .. } => ("TruncatedDataError", None),
        CoreError::Layout { .. } => ("LayoutError", None),
        CoreError::InvalidArgument(_) => ("InvalidArgumentError", None),
        CoreError::UnsafePath { .. } => ("UnsafePathError", None),
        CoreError::Exists { .. } => ("CheckpointExistsError", None),
        CoreError::Locked { .. } => ("CheckpointLockedError", None),
        _ => ("OlmoChunksError", None),
    };
    let made = py
        .import("olmo_chunks.errors")
        .and_then(|m| m.getattr(class))
        .and_then(|cls| match os {
            Some((errno, path)) => cls.call1((errno, msg.clone(), path)),
            None => cls.call1((msg.clone(),)),
        });
    match made {
        Ok(value) => PyErr::from_value(value),
        Err(_) => PyRuntimeError::new_err(msg),
    }
}

/// Runs `f` without the GIL and converts its error.
fn detach<T: Send>(py: Python<'_>, f: impl FnOnce() -> core::Result<T> + Send) -> PyResult<T> {
    py.detach(f).map_err(|e| to_pyerr(py, e))
}

fn worker_count(n: Option<usize>) -> usize {
    n.unwrap_or_else(core::default_workers)
}

/// Raw (pointer, length) buffers handed over by Python, turned into disjoint byte slices.
fn as_slices<'a>(raw: &[(usize, usize)]) -> Result<Vec<&'a mut [u8]>, CoreError> {
    let mut spans: Vec<(usize, usize)> = raw.iter().copied().filter(|&(_, n)| n > 0).collect();
    spans.sort_unstable();
    if spans.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
        return Err(CoreError::InvalidArgument(
            "destination tensors share memory".into(),
        ));
    }
    Ok(raw
        .iter()
        .map(|&(ptr, len)| {
            if len == 0 {
                return &mut [][..];
            }
            // SAFETY: the Python caller (olmo_chunks) passes `data_ptr()` and byte size of live,
            // writable, contiguous-storage CPU tensors that it keeps referenced for the whole call and
            // does not touch concurrently; the check above proves the spans are disjoint.
            unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
        })
        .collect())
}

/// A decoded, validated checkpoint manifest.
#[pyclass(name = "Manifest", module = "olmo_chunks._core", frozen)]
struct PyManifest {
    inner: Arc<Manifest>,
    storage: Arc<dyn Storage>,
}

/// A location argument: a local path (`str` or `os.PathLike`) or a URL string.
fn location(path: &std::path::Path) -> String {
    path.to_string_lossy().into_owned()
}

#[pymethods]
impl PyManifest {
    /// Reads the committed manifest of the checkpoint at `path` (a directory or an `s3://` or
    /// `gs://` URL).
    #[staticmethod]
    fn open(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let (m, storage) = detach(py, || core::open_checkpoint(&location(&path)))?;
        Ok(PyManifest {
            inner: Arc::new(m),
            storage,
        })
    }

    /// Decodes manifest bytes read by another rank ([`Manifest.read_bytes`]) for the checkpoint at
    /// `path`.
    #[staticmethod]
    fn from_bytes(py: Python<'_>, path: PathBuf, data: &[u8]) -> PyResult<Self> {
        let data = data.to_vec();
        let (m, storage) = detach(py, move || {
            let storage = core::storage_at(&location(&path))?;
            Ok((
                Manifest::decode(&data, &storage.name(core::MANIFEST_NAME))?,
                storage,
            ))
        })?;
        Ok(PyManifest {
            inner: Arc::new(m),
            storage,
        })
    }

    /// The committed manifest's bytes, read (with the checks of `open`) but not decoded.
    #[staticmethod]
    fn read_bytes(py: Python<'_>, path: PathBuf) -> PyResult<Py<pyo3::types::PyBytes>> {
        let (bytes, _) = detach(py, || core::checkpoint_bytes(&location(&path)))?;
        Ok(pyo3::types::PyBytes::new(py, &bytes).unbind())
    }

    #[getter]
    fn format_version(&self) -> u32 {
        self.inner.format_version()
    }
    #[getter]
    fn save_id(&self) -> &str {
        &self.inner.save_id
    }
    #[getter]
    fn block_size(&self) -> u64 {
        self.inner.block_size
    }
    #[getter]
    fn num_chunks(&self) -> usize {
        self.inner.chunks.len()
    }
    /// Every data file, in manifest order (a chunk's `file` indexes this list).
    #[getter]
    fn files(&self) -> Vec<PyFileInfo> {
        self.inner
            .files
            .iter()
            .map(|f| PyFileInfo {
                path: f.path.clone(),
                size: f.size,
            })
            .collect()
    }
    /// Every tensor, in manifest order (its position is the `t` of `chunks(t)`).
    #[getter]
    fn tensors(&self) -> Vec<PyTensorInfo> {
        let m = &self.inner;
        m.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| PyTensorInfo {
                key: t.key.clone(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                role: t.role.clone(),
                chunks: t.chunks,
                nbytes: m.tensor_chunks(i).iter().map(|c| c.len).sum(),
                stored_nbytes: m.tensor_chunks(i).iter().map(|c| m.stored_len(c)).sum(),
            })
            .collect()
    }
    #[getter]
    fn entries_json(&self) -> String {
        self.inner.entries.get().to_string()
    }
    #[getter]
    fn info_json(&self) -> String {
        self.inner.info.get().to_string()
    }
    /// Each saved chunk of tensor `t`: its region and where its bytes lie.
    fn chunks(&self, py: Python<'_>, t: usize) -> PyResult<Vec<PyChunkInfo>> {
        if t >= self.inner.tensors.len() {
            return Err(to_pyerr(
                py,
                CoreError::InvalidArgument(format!("tensor index {t} out of range")),
            ));
        }
        Ok(self
            .inner
            .tensor_chunks(t)
            .iter()
            .map(|c| PyChunkInfo {
                region: c.region.clone(),
                file: c.file,
                offset: c.offset,
                nbytes: c.len,
                codec: codec_name(c.codec).to_string(),
                stored_nbytes: self.inner.stored_len(c),
            })
            .collect())
    }
    /// The saved chunks of tensor `t` as boxes `(offsets, sizes)`, as torch DCP lists them: empty
    /// boxes left out, a flat range as the boxes it decomposes into.
    fn saved_boxes(&self, py: Python<'_>, t: usize) -> PyResult<Vec<PyBox>> {
        if t >= self.inner.tensors.len() {
            return Err(to_pyerr(
                py,
                CoreError::InvalidArgument(format!("tensor index {t} out of range")),
            ));
        }
        Ok(saved_boxes(&self.inner, t))
    }
    /// `box_overlaps` against the saved boxes of manifest tensors (`saved_boxes`): for each of
    /// `tensors`, the overlaps with its `wanted` boxes. No Python object per saved chunk is made.
    fn overlaps(
        &self,
        py: Python<'_>,
        tensors: Vec<usize>,
        wanted: Vec<Vec<PyBox>>,
    ) -> PyResult<Vec<Vec<PyOverlap>>> {
        if tensors.len() != wanted.len() {
            return Err(to_pyerr(
                py,
                CoreError::InvalidArgument(format!(
                    "{} tensors, {} lists of wanted boxes",
                    tensors.len(),
                    wanted.len()
                )),
            ));
        }
        let m = self.inner.clone();
        detach(py, move || {
            tensors
                .iter()
                .zip(&wanted)
                .map(|(t, wanted)| {
                    Ok(core::load::tensor_overlaps(&m, *t, &box_pairs(wanted))?
                        .into_iter()
                        .map(|(o, at)| PyOverlap::new(o, at))
                        .collect())
                })
                .collect()
        })
    }
    /// Checks that every tensor is covered by its chunks exactly once.
    fn check_coverage(&self, py: Python<'_>) -> PyResult<()> {
        let m = self.inner.clone();
        detach(py, move || core::check_manifest_coverage(&m))
    }
    /// Reads every chunk and checks its checksums; returns the bytes verified. `progress`, when
    /// given, is called about every 100 ms with the bytes verified so far (last with the total);
    /// an exception it raises stops the calls and is raised once verification has finished.
    #[pyo3(signature = (workers=None, progress=None))]
    fn verify_data(
        &self,
        py: Python<'_>,
        workers: Option<usize>,
        progress: Option<Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let (m, storage, workers) = (
            self.inner.clone(),
            self.storage.clone(),
            worker_count(workers),
        );
        let Some(progress) = progress else {
            return detach(py, move || core::verify_from(&*storage, &m, workers, None));
        };
        let done = AtomicU64::new(0);
        let caller = std::thread::current();
        let (verified, failed) = std::thread::scope(|s| {
            let job = std::thread::Builder::new().spawn_scoped(s, || {
                let r = core::verify_from(&*storage, &m, workers, Some(&done));
                caller.unpark();
                r
            });
            let job = match job {
                Ok(job) => job,
                Err(e) => return (Err(CoreError::no_thread(e)), None),
            };
            let (mut shown, mut failed) = (0, None);
            let mut report = |now: u64| {
                if now > shown && failed.is_none() {
                    shown = now;
                    failed = progress.call1((now,)).err();
                }
            };
            while !job.is_finished() {
                report(done.load(Ordering::Relaxed));
                py.detach(|| std::thread::park_timeout(Duration::from_millis(100)));
            }
            let verified = job.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
            report(done.load(Ordering::Relaxed)); // joined: the total is visible now
            (verified, failed)
        });
        let verified = verified.map_err(|e| to_pyerr(py, e))?;
        failed.map_or(Ok(verified), Err)
    }
    /// The element runs filling each target (`Run.target` indexes `targets`; their buffers are
    /// not looked at).
    fn plan_runs(&self, py: Python<'_>, targets: Vec<PyRef<'_, PyTarget>>) -> PyResult<Vec<PyRun>> {
        let m = self.inner.clone();
        let targets: Vec<core::Target> = targets
            .iter()
            .enumerate()
            .map(|(i, t)| core::Target {
                tensor: t.tensor,
                pieces: t.pieces.iter().map(Piece::from).collect(),
                dest: i,
                dest_len: u64::MAX,
            })
            .collect();
        detach(py, move || {
            let runs = core::plan_runs(&m, &targets)?;
            Ok(runs
                .into_iter()
                .map(|r| PyRun {
                    chunk: r.src - m.chunk_start[targets[r.dst].tensor],
                    src: r.src_elem,
                    target: r.dst,
                    dst: r.dst_elem,
                    len: r.len,
                })
                .collect())
        })
    }
    /// Fills destination buffers (`(address, nbytes)` of live CPU memory) from the checkpoint.
    #[pyo3(signature = (targets, buffers, verify=true, workers=None))]
    fn load(
        &self,
        py: Python<'_>,
        targets: Vec<PyRef<'_, PyTarget>>,
        buffers: Vec<(usize, usize)>,
        verify: bool,
        workers: Option<usize>,
    ) -> PyResult<()> {
        let (m, storage) = (self.inner.clone(), self.storage.clone());
        let lens: Vec<usize> = buffers.iter().map(|b| b.1).collect();
        let ts = to_targets(&targets, &lens).map_err(|e| to_pyerr(py, e))?;
        detach(py, move || {
            let copies = core::plan_copies(&m, &ts)?;
            core::read_from(
                &*storage,
                &m,
                copies,
                as_slices(&buffers)?,
                verify,
                worker_count(workers),
            )
        })
    }
}

/// Core targets over buffers of `lens` bytes.
fn to_targets(
    targets: &[PyRef<'_, PyTarget>],
    lens: &[usize],
) -> Result<Vec<core::Target>, CoreError> {
    targets
        .iter()
        .map(|t| {
            let Some(&dest_len) = lens.get(t.buffer) else {
                return Err(CoreError::InvalidArgument(format!(
                    "buffer index {} out of range",
                    t.buffer
                )));
            };
            Ok(core::Target {
                tensor: t.tensor,
                pieces: t.pieces.iter().map(Piece::from).collect(),
                dest: t.buffer,
                dest_len: dest_len as u64,
            })
        })
        .collect()
}

/// One rank's side of a cooperative load (see `olmo_chunks.fill`): its byte copies, what it needs
/// of each saved block, and, once planned, its rounds.
#[pyclass(name = "ReadOnce", module = "olmo_chunks._core")]
struct PyReadOnce {
    m: Arc<Manifest>,
    storage: Arc<dyn Storage>,
    copies: Vec<core::ByteCopy>,
    lens: Vec<usize>,
    loaded: bool,
    plan: core::coop::ReadPlan,
    by_round: Vec<Vec<core::ByteCopy>>,
}

impl PyReadOnce {
    /// `InvalidArgumentError` unless `buffers` are as many as planned.
    fn check_buffers(&self, py: Python<'_>, buffers: &[(usize, usize)]) -> PyResult<()> {
        if buffers.len() == self.lens.len() {
            return Ok(());
        }
        Err(to_pyerr(
            py,
            CoreError::InvalidArgument(format!(
                "{} buffers given for {}",
                buffers.len(),
                self.lens.len()
            )),
        ))
    }
    fn round(&self, py: Python<'_>, k: usize) -> PyResult<&core::coop::Round> {
        self.plan.rounds.get(k).ok_or_else(|| {
            to_pyerr(
                py,
                CoreError::InvalidArgument(format!("round {k} out of range")),
            )
        })
    }
}

#[pymethods]
impl PyReadOnce {
    /// Plans the copies of `targets` into buffers of `buffer_lens` bytes, as `Manifest.load` does.
    #[new]
    fn new(
        py: Python<'_>,
        manifest: &PyManifest,
        targets: Vec<PyRef<'_, PyTarget>>,
        buffer_lens: Vec<usize>,
    ) -> PyResult<Self> {
        let m = manifest.inner.clone();
        let ts = to_targets(&targets, &buffer_lens).map_err(|e| to_pyerr(py, e))?;
        let mm = m.clone();
        let copies = detach(py, move || core::plan_copies(&mm, &ts))?;
        Ok(PyReadOnce {
            m,
            storage: manifest.storage.clone(),
            copies,
            lens: buffer_lens,
            loaded: false,
            plan: Default::default(),
            by_round: Vec::new(),
        })
    }
    /// Bytes all copies move.
    #[getter]
    fn total(&self) -> u64 {
        self.copies.iter().map(|c| c.len).sum()
    }
    /// What this rank needs of each saved block, in the wire form `plan_read_once` takes.
    fn needs(&self, py: Python<'_>) -> Py<pyo3::types::PyBytes> {
        let needs = core::coop::needs(&self.m, &self.copies);
        pyo3::types::PyBytes::new(py, &core::coop::encode_needs(&needs)).unbind()
    }
    /// Reads directly (as `Manifest.load`, without planning again) the copies into the first
    /// `len(buffers)` buffers, which must have the lengths they were planned with; the others are
    /// left to the caller. Spends the copies: a second call is refused.
    /// With `trusted` (this rank's item of `ReadChoice.trusted`), the blocks another rank of this
    /// host checks, or that its ranks check in part, are not checked whole here, and only this
    /// rank's bytes of them are read. Returns this rank's shares of the blocks checked in part
    /// (`(xor of them, their wire form)`, against `ReadChoice.split_sum` and for `check_shares`),
    /// or `None`.
    #[pyo3(signature = (buffers, verify=true, workers=None, trusted=None))]
    fn load(
        &mut self,
        py: Python<'_>,
        buffers: Vec<(usize, usize)>,
        verify: bool,
        workers: Option<usize>,
        trusted: Option<&[u8]>,
    ) -> PyResult<Option<(u32, Py<pyo3::types::PyBytes>)>> {
        let checks = trusted
            .map(|t| core::coop::decode_checks(&self.m, t))
            .transpose()
            .map_err(|e| to_pyerr(py, e))?
            .unwrap_or_default();
        if self.loaded {
            return Err(to_pyerr(
                py,
                CoreError::InvalidArgument(
                    "this ReadOnce was loaded already (its copies are spent)".into(),
                ),
            ));
        }
        let n = buffers.len();
        if n > self.lens.len() || buffers.iter().zip(&self.lens).any(|(b, &len)| b.1 != len) {
            let lens: Vec<usize> = buffers.iter().map(|b| b.1).collect();
            return Err(to_pyerr(
                py,
                CoreError::InvalidArgument(format!(
                    "buffers of {lens:?} bytes given for buffers planned as {:?}",
                    self.lens
                )),
            ));
        }
        let mut copies = std::mem::take(&mut self.copies);
        self.loaded = true;
        copies.retain(|c| c.dst < n);
        let (m, storage) = (self.m.clone(), self.storage.clone());
        let split = !checks.split.is_empty();
        let shares = detach(py, move || {
            core::io::read_from_trusting(
                &*storage,
                &m,
                copies,
                as_slices(&buffers)?,
                verify,
                &checks,
                worker_count(workers),
            )
        })?;
        Ok(split.then(|| {
            let wire = core::coop::encode_shares(&shares);
            (
                core::coop::share_sum(&shares),
                pyo3::types::PyBytes::new(py, &wire).unbind(),
            )
        }))
    }
    /// Takes this rank's plan (one item of `plan_read_once`'s result).
    fn start(&mut self, py: Python<'_>, plan: &[u8]) -> PyResult<()> {
        let plan = core::coop::ReadPlan::decode(plan)
            .and_then(|p| p.check(&self.m).map(|_| p))
            .map_err(|e| to_pyerr(py, e))?;
        self.plan = plan;
        self.by_round = self.plan.copies_by_round(&self.m, &self.copies);
        Ok(())
    }
    #[getter]
    fn rounds(&self) -> usize {
        self.plan.rounds.len()
    }
    /// The bytes round `k` reads, sends and receives.
    fn round_bytes(&self, py: Python<'_>, k: usize) -> PyResult<PyRoundBytes> {
        let r = self.round(py, k)?;
        let sizes = |peers: &[(u32, Vec<core::coop::Span>)]| {
            peers
                .iter()
                .map(|(p, s)| (*p, s.iter().map(|s| s.bytes()).sum()))
                .collect()
        };
        Ok(PyRoundBytes {
            read: r.read_len(),
            sends: sizes(&r.sends),
            recvs: sizes(&r.recvs),
        })
    }
    /// `(first, last)` round writing into each buffer, `None` for a buffer no round writes.
    fn buffer_rounds(&self) -> Vec<Option<(usize, usize)>> {
        let mut out: Vec<Option<(usize, usize)>> = vec![None; self.lens.len()];
        for (k, copies) in self.by_round.iter().enumerate() {
            for c in copies {
                let e = out[c.dst].get_or_insert((k, k));
                e.1 = k;
            }
        }
        out
    }
    /// Reads round `k`'s blocks: this rank's own bytes of them straight into `buffers` (as
    /// `fill` takes them), what goes to each peer packed into `send` (`(address, nbytes)` of CPU
    /// buffers). Returns the seconds the reads took and the bytes copied into `buffers`.
    #[pyo3(signature = (k, send, buffers, verify=true, workers=None))]
    fn read(
        &self,
        py: Python<'_>,
        k: usize,
        send: (usize, usize),
        buffers: Vec<(usize, usize)>,
        verify: bool,
        workers: Option<usize>,
    ) -> PyResult<(f64, u64)> {
        let round = self.round(py, k)?;
        self.check_buffers(py, &buffers)?;
        let (m, storage, copies) = (&self.m, &self.storage, &self.by_round[k]);
        detach(py, move || {
            let mut all = buffers;
            all.push(send);
            let mut dests = as_slices(&all)?;
            let send = dests.pop().unwrap();
            core::coop::read_round(
                &**storage,
                m,
                round,
                copies,
                send,
                dests,
                verify,
                worker_count(workers),
            )
        })
    }
    /// Copies round `k`'s bytes received (`recv`) into `buffers`; returns the bytes copied.
    #[pyo3(signature = (k, recv, buffers, workers=None))]
    fn fill(
        &self,
        py: Python<'_>,
        k: usize,
        recv: (usize, usize),
        buffers: Vec<(usize, usize)>,
        workers: Option<usize>,
    ) -> PyResult<u64> {
        let round = self.round(py, k)?;
        self.check_buffers(py, &buffers)?;
        let copies = &self.by_round[k];
        detach(py, move || {
            let v = as_slices(&[recv])?.pop().unwrap();
            core::coop::fill_round(
                round,
                v,
                copies,
                as_slices(&buffers)?,
                worker_count(workers),
            )
        })
    }
}

/// Plans a cooperative load from every rank's `ReadOnce.needs()` (in rank order): one plan per
/// rank, in rounds within `budget` bytes per rank. With `rates`, also predicts the seconds of the
/// load read directly and read once (`core::coop::predict`), and plans only if reading once is
/// predicted faster. No plan (each rank reads its own) when no saved block is needed by more than
/// one rank, unless `force`. With `hosts` (each rank's host, ranks of one host reading through one
/// page cache), a load read directly has each shared block checked by one rank per host, or in
/// part by each rank that needs it (`core::coop::delegate_checks`; the prediction counts it so),
/// and `trusted` says which.
#[pyfunction]
#[pyo3(signature = (manifest, needs, budget, force=false, rates=None, hosts=None))]
fn plan_read_once(
    py: Python<'_>,
    manifest: &PyManifest,
    needs: Vec<Vec<u8>>,
    budget: u64,
    force: bool,
    rates: Option<PyRef<'_, PyRates>>,
    hosts: Option<Vec<u64>>,
) -> PyResult<PyReadChoice> {
    let m = manifest.inner.clone();
    let rates = rates.map(|r| r.inner());
    if hosts.as_ref().is_some_and(|h| h.len() != needs.len()) {
        return Err(to_pyerr(
            py,
            CoreError::InvalidArgument("one host per rank's needs".into()),
        ));
    }
    let (plans, predicted, trusted, split_sum) = detach(py, move || {
        let needs = needs
            .iter()
            .map(|b| core::coop::decode_needs(b))
            .collect::<core::Result<Vec<_>>>()?;
        let shared = core::coop::shared(&needs);
        if !force && !shared && rates.is_none() {
            return Ok((None, None, None, None));
        }
        let plans = core::coop::plan(&m, &needs, budget)?;
        let trusted = hosts
            .filter(|_| shared)
            .map(|h| core::coop::delegate_checks(&m, &needs, &h))
            .filter(|t| t.iter().any(|c| !c.trusted.is_empty()));
        let direct = core::coop::direct_bytes(&m, &needs, trusted.as_deref().unwrap_or(&[]));
        let predicted = rates.map(|r| core::coop::predict(&direct, &plans, &r));
        let once = force || (shared && predicted.is_none_or(|p| p.once < p.direct));
        let plans = once.then(|| plans.iter().map(|p| p.encode()).collect::<Vec<_>>());
        let trusted = trusted.filter(|_| !once);
        let split_sum = trusted.as_ref().map(|t| {
            let mut split: Vec<(u64, u64)> =
                t.iter().flat_map(|c| c.split.iter().copied()).collect();
            split.sort_unstable();
            split.dedup();
            core::coop::split_sum(&m, &split)
        });
        let trusted = trusted.map(|t| t.iter().map(core::coop::encode_checks).collect::<Vec<_>>());
        Ok((plans, predicted, trusted, split_sum))
    })?;
    let to_py = |ps: Vec<Vec<u8>>| {
        ps.iter()
            .map(|p| pyo3::types::PyBytes::new(py, p).unbind())
            .collect()
    };
    Ok(PyReadChoice {
        plans: plans.map(to_py),
        direct_s: predicted.map(|p| p.direct),
        once_s: predicted.map(|p| p.once),
        trusted: trusted.map(to_py),
        split_sum,
    })
}

/// Checks the blocks checked in part from the shares of the ranks that split them
/// (`ReadOnce.load`'s second items): `ChecksumMismatch` naming the first block whose shares do
/// not add up.
#[pyfunction]
fn check_shares(py: Python<'_>, manifest: &PyManifest, shares: Vec<Vec<u8>>) -> PyResult<()> {
    let (m, storage) = (manifest.inner.clone(), manifest.storage.clone());
    detach(py, move || {
        let mut all = Vec::new();
        for s in &shares {
            all.extend(core::coop::decode_shares(s)?);
        }
        core::coop::check_shares(&m, &all, &|rel| storage.name(rel))
    })
}

/// Whether any saved block is needed by more than one rank, from every rank's
/// `ReadOnce.needs()` (when none is, reading once cannot pay and no exchange need be measured).
#[pyfunction]
fn blocks_shared(py: Python<'_>, needs: Vec<Vec<u8>>) -> PyResult<bool> {
    detach(py, move || {
        let needs = needs
            .iter()
            .map(|b| core::coop::decode_needs(b))
            .collect::<core::Result<Vec<_>>>()?;
        Ok(core::coop::shared(&needs))
    })
}

/// Caps this process's storage reads at `bytes_per_s` (0 lifts it) for the checkpoints opened
/// from now on (`core::pace`), for benchmarks modelling slower shared storage; `pace_read(n)`
/// makes a reader outside the core share the cap.
#[pyfunction]
fn set_read_pace(bytes_per_s: u64) {
    core::pace::set_read_pace(bytes_per_s)
}

/// The cap of `set_read_pace` in bytes per second (0: none).
#[pyfunction]
fn read_pace() -> u64 {
    core::pace::read_pace()
}

/// Waits as long as reading `n` bytes takes under the cap of `set_read_pace`.
#[pyfunction]
fn pace_read(py: Python<'_>, n: u64) {
    py.detach(|| core::pace::pace_read(n))
}

/// The path, below the checkpoint, of data file `part` of `rank` in save `save_id` (the core names
/// every data file, so its cleanup recognises them).
#[pyfunction]
fn data_file(save_id: &str, rank: usize, part: usize) -> String {
    core::txn::data_file_name(save_id, rank, part)
}

/// Who writes what in a save: `held[r]` lists rank `r`'s chunks as `(id, bytes)`, equal ids being
/// replicas of one chunk; returns per rank the indices into `held[r]` it writes (each distinct
/// chunk once, bytes balanced; `core::assign`).
#[pyfunction]
fn assign_writers(py: Python<'_>, held: Vec<Vec<(u64, u64)>>) -> Vec<Vec<usize>> {
    py.detach(|| core::assign::assign_writers(&held))
}

/// Runs the backend suite (`core::conformance`) on the empty storage at `path` (a directory or
/// a URL); returns the expectations it failed (none: the backend conforms).
#[pyfunction]
fn check_storage(py: Python<'_>, path: PathBuf) -> PyResult<Vec<String>> {
    let storage = core::storage_at(&location(&path)).map_err(|e| to_pyerr(py, e))?;
    Ok(py.detach(|| core::conformance::check(storage)))
}

/// Opens regular file `rel` strictly beneath directory `root` for reading, as the core opens data
/// files (no symlink below `root` followed, never blocking on a FIFO); returns its descriptor,
/// which the caller owns.
#[pyfunction]
fn open_beneath(py: Python<'_>, root: &str, rel: &str) -> PyResult<i32> {
    use std::os::fd::IntoRawFd;
    let file = py
        .detach(|| core::fsutil::open_beneath(std::path::Path::new(root), rel))
        .map_err(|e| to_pyerr(py, e))?;
    Ok(file.into_raw_fd())
}

/// Bytes read from and written to storage by this process so far, through the core.
#[pyfunction]
fn io_counters() -> (u64, u64) {
    let c = &core::storage::PROCESS_IO;
    (
        c.read.load(Ordering::Relaxed),
        c.written.load(Ordering::Relaxed),
    )
}

/// The pieces of the flat range `[start, start + len)` of a tensor of `shape`, with local offsets
/// counted from `start`.
#[pyfunction]
fn flat_pieces(py: Python<'_>, shape: Vec<u64>, start: u64, len: u64) -> PyResult<Vec<PyPiece>> {
    let r = Region::Flat { start, len };
    r.check_bounds(&shape)
        .map_err(|why| to_pyerr(py, CoreError::InvalidArgument(why)))?;
    Ok(r.pieces(&shape).into_iter().map(PyPiece::from).collect())
}

/// Contiguous runs `(flat_start, len, local_start)` of the box `offsets`/`sizes` of a tensor of
/// `shape`: flat positions in the canonical (row-major) order of `shape`, local ones in the box's
/// own row-major order.
#[pyfunction]
fn box_runs(
    py: Python<'_>,
    shape: Vec<u64>,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
) -> PyResult<Vec<(u64, u64, u64)>> {
    let r = Region::Box {
        offsets: offsets.clone(),
        sizes: sizes.clone(),
    };
    r.check_bounds(&shape)
        .map_err(|why| to_pyerr(py, CoreError::InvalidArgument(why)))?;
    let mut out = Vec::new();
    if sizes.contains(&0) {
        return Ok(out);
    }
    let global = Piece {
        offsets: vec![0; shape.len()],
        sizes: shape.clone(),
        local_start: 0,
        strides: core::region::row_major_strides(&shape),
    };
    let local = Piece {
        offsets: offsets.clone(),
        sizes: sizes.clone(),
        local_start: 0,
        strides: core::region::row_major_strides(&sizes),
    };
    core::region::for_each_run(&offsets, &sizes, &global, &local, |g, l, n| {
        out.push((g, n, l))
    });
    Ok(out)
}

fn saved_boxes(m: &Manifest, t: usize) -> Vec<PyBox> {
    let mut out = Vec::new();
    core::load::for_each_saved_box(m, t, |o, s| {
        out.push(PyBox {
            offsets: o.to_vec(),
            sizes: s.to_vec(),
        })
    });
    out
}

/// The `(offsets, sizes)` pairs the core's box functions take.
fn box_pairs(boxes: &[PyBox]) -> Vec<(Vec<u64>, Vec<u64>)> {
    boxes
        .iter()
        .map(|b| (b.offsets.clone(), b.sizes.clone()))
        .collect()
}

/// Every non-empty overlap of `saved` and `wanted` boxes of an `ndim`-d tensor, wanted box by
/// wanted box, saved boxes ascending.
#[pyfunction]
fn box_overlaps(
    py: Python<'_>,
    ndim: usize,
    saved: Vec<PyBox>,
    wanted: Vec<PyBox>,
) -> PyResult<Vec<PyOverlap>> {
    detach(py, move || {
        let saved = box_pairs(&saved);
        Ok(core::box_overlaps(ndim, &saved, &box_pairs(&wanted))?
            .into_iter()
            .map(|o| {
                let at = saved[o.saved].0.clone();
                PyOverlap::new(o, at)
            })
            .collect())
    })
}

/// A data file of a checkpoint (`Manifest.files`): its path below the checkpoint and its size.
#[pyclass(name = "FileInfo", module = "olmo_chunks._core", frozen, get_all)]
#[derive(Clone, PartialEq)]
struct PyFileInfo {
    path: String,
    size: u64,
}

#[pymethods]
impl PyFileInfo {
    #[new]
    fn new(path: String, size: u64) -> Self {
        PyFileInfo { path, size }
    }
    fn __eq__(&self, other: &Self) -> bool {
        self == other
    }
    fn __repr__(&self) -> String {
        format!("FileInfo(path={:?}, size={})", self.path, self.size)
    }
}

/// A saved tensor (`Manifest.tensors`): its schema, how many chunks hold it and their bytes.
#[pyclass(name = "TensorInfo", module = "olmo_chunks._core", frozen, get_all)]
#[derive(Clone, PartialEq)]
struct PyTensorInfo {
    key: String,
    dtype: String,
    shape: Vec<u64>,
    role: String,
    chunks: usize,
    nbytes: u64,
    /// Bytes its chunks take in the data files (less than `nbytes` when compressed).
    stored_nbytes: u64,
}

#[pymethods]
impl PyTensorInfo {
    #[new]
    #[pyo3(signature = (key, dtype, shape, role, chunks, nbytes, stored_nbytes=None))]
    fn new(
        key: String,
        dtype: String,
        shape: Vec<u64>,
        role: String,
        chunks: usize,
        nbytes: u64,
        stored_nbytes: Option<u64>,
    ) -> Self {
        PyTensorInfo {
            key,
            dtype,
            shape,
            role,
            chunks,
            nbytes,
            stored_nbytes: stored_nbytes.unwrap_or(nbytes),
        }
    }
    fn __eq__(&self, other: &Self) -> bool {
        self == other
    }
    fn __repr__(&self) -> String {
        format!(
            "TensorInfo(key={:?}, dtype={:?}, shape={:?}, role={:?}, chunks={}, nbytes={}, stored_nbytes={})",
            self.key, self.dtype, self.shape, self.role, self.chunks, self.nbytes, self.stored_nbytes
        )
    }
}

/// A saved chunk of a tensor (`Manifest.chunks(t)`): its region (a `Box` or a `Flat`), and
/// `nbytes` bytes at `offset` of data file `file` (an index into `Manifest.files`).
#[pyclass(name = "ChunkInfo", module = "olmo_chunks._core", frozen)]
#[derive(Clone, PartialEq)]
struct PyChunkInfo {
    region: Region,
    #[pyo3(get)]
    file: u32,
    #[pyo3(get)]
    offset: u64,
    #[pyo3(get)]
    nbytes: u64,
    /// "raw" or "zstd".
    #[pyo3(get)]
    codec: String,
    /// Bytes the chunk takes in its file (`nbytes` when raw).
    #[pyo3(get)]
    stored_nbytes: u64,
}

#[pymethods]
impl PyChunkInfo {
    #[new]
    #[pyo3(signature = (region, file, offset, nbytes, codec="raw".to_string(), stored_nbytes=None))]
    fn new(
        region: RegionArg,
        file: u32,
        offset: u64,
        nbytes: u64,
        codec: String,
        stored_nbytes: Option<u64>,
    ) -> Self {
        PyChunkInfo {
            region: region.into(),
            file,
            offset,
            nbytes,
            codec,
            stored_nbytes: stored_nbytes.unwrap_or(nbytes),
        }
    }
    fn __eq__(&self, other: &Self) -> bool {
        self == other
    }
    #[getter]
    fn region(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        region_py(py, &self.region)
    }
    fn __repr__(&self) -> String {
        format!(
            "ChunkInfo(region={:?}, file={}, offset={}, nbytes={}, codec={:?}, stored_nbytes={})",
            self.region, self.file, self.offset, self.nbytes, self.codec, self.stored_nbytes
        )
    }
}

/// A global tensor as a save describes it (`olmo_chunks._core.TensorSchema`).
#[pyclass(name = "TensorSchema", module = "olmo_chunks._core", frozen, get_all)]
#[derive(Clone)]
struct PyTensorSchema {
    key: String,
    dtype: String,
    shape: Vec<u64>,
    role: String,
}

#[pymethods]
impl PyTensorSchema {
    #[new]
    fn new(key: String, dtype: String, shape: Vec<u64>, role: String) -> Self {
        PyTensorSchema {
            key,
            dtype,
            shape,
            role,
        }
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let s = slf.get();
        let args = (
            s.key.clone(),
            s.dtype.clone(),
            s.shape.clone(),
            s.role.clone(),
        );
        (slf.get_type(), args).into_pyobject(slf.py())
    }
    fn __eq__(&self, other: &Self) -> bool {
        (&self.key, &self.dtype, &self.shape, &self.role)
            == (&other.key, &other.dtype, &other.shape, &other.role)
    }
    fn __repr__(&self) -> String {
        format!(
            "TensorSchema(key={:?}, dtype={:?}, shape={:?}, role={:?})",
            self.key, self.dtype, self.shape, self.role
        )
    }
}

/// One chunk a rank wrote (`olmo_chunks._core.WrittenChunk`): its region of tensor `key` (a
/// `Box` or a `Flat`) and where its bytes lie. Picklable: ranks send these to the rank that
/// commits.
#[pyclass(name = "WrittenChunk", module = "olmo_chunks._core", frozen)]
#[derive(Clone)]
struct PyWrittenChunk {
    #[pyo3(get)]
    key: String,
    region: Region,
    #[pyo3(get)]
    file: String,
    #[pyo3(get)]
    file_size: u64,
    #[pyo3(get)]
    offset: u64,
    #[pyo3(get)]
    nbytes: u64,
    #[pyo3(get)]
    checksums: Vec<u32>,
    /// "raw", or "zstd" with its `shuffle` width and each block's stored length.
    #[pyo3(get)]
    codec: String,
    #[pyo3(get)]
    shuffle: u8,
    #[pyo3(get)]
    block_lens: Vec<u32>,
}

#[pymethods]
impl PyWrittenChunk {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (key, region, file, file_size, offset, nbytes, checksums, codec="raw".to_string(), shuffle=0, block_lens=Vec::new()))]
    fn new(
        key: String,
        region: RegionArg,
        file: String,
        file_size: u64,
        offset: u64,
        nbytes: u64,
        checksums: Vec<u32>,
        codec: String,
        shuffle: u8,
        block_lens: Vec<u32>,
    ) -> Self {
        PyWrittenChunk {
            key,
            region: region.into(),
            file,
            file_size,
            offset,
            nbytes,
            checksums,
            codec,
            shuffle,
            block_lens,
        }
    }
    #[getter]
    fn region(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        region_py(py, &self.region)
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let c = slf.get().clone();
        let args = (
            c.key,
            region_py(py, &c.region)?,
            c.file,
            c.file_size,
            c.offset,
            c.nbytes,
            c.checksums,
            c.codec,
            c.shuffle,
            c.block_lens,
        );
        (slf.get_type(), args).into_pyobject(py)
    }
    fn __repr__(&self) -> String {
        format!(
            "WrittenChunk(key={:?}, {:?}, file={:?}, offset={}, nbytes={})",
            self.key, self.region, self.file, self.offset, self.nbytes
        )
    }
}

impl PyWrittenChunk {
    fn to_core(&self) -> Result<core::SavedChunk, CoreError> {
        Ok(core::SavedChunk {
            key: self.key.clone(),
            region: self.region.clone(),
            file: self.file.clone(),
            file_size: self.file_size,
            offset: self.offset,
            len: self.nbytes,
            checksums: self.checksums.clone(),
            codec: match (self.codec.as_str(), self.shuffle) {
                ("raw", 0) => core::Codec::Raw,
                ("zstd", shuffle) => core::Codec::Zstd { shuffle },
                (c, s) => {
                    return Err(CoreError::InvalidArgument(format!(
                        "unknown chunk encoding {c:?} (shuffle {s})"
                    )))
                }
            },
            block_lens: self.block_lens.clone(),
        })
    }
}

/// Writes one fresh data file `rel_path` under `dir` (a directory or URL) holding `items`, each
/// compressed with zstd at `zstd_level` when given, makes it durable, and returns a
/// `WrittenChunk` per item.
#[pyfunction]
#[pyo3(signature = (dir, rel_path, items, block_size, workers=None, zstd_level=None))]
fn write_chunks(
    py: Python<'_>,
    dir: PathBuf,
    rel_path: String,
    items: Vec<PyRef<'_, PyWriteItem>>,
    block_size: u64,
    workers: Option<usize>,
    zstd_level: Option<i32>,
) -> PyResult<Vec<PyWrittenChunk>> {
    let datas: Vec<&[u8]> = items
        .iter()
        .map(|item| {
            if item.nbytes == 0 {
                return &[][..];
            }
            // SAFETY: the Python caller passes `data_ptr()` and byte size of live contiguous CPU
            // tensors that it keeps referenced and unmodified for the whole call; we only read.
            unsafe { std::slice::from_raw_parts(item.address as *const u8, item.nbytes) }
        })
        .collect();
    let rel = vec![rel_path];
    let (written, files) = detach(py, || {
        let items: Vec<core::WriteItem<'_>> = datas
            .iter()
            .map(|&data| core::WriteItem { file: 0, data })
            .collect();
        let storage = core::storage_at(&location(&dir))?;
        core::write_chunks_with(
            &*storage,
            &rel,
            &items,
            block_size,
            worker_count(workers),
            zstd_level,
        )
    })?;
    let file = &files[0];
    Ok(items
        .iter()
        .zip(written)
        .map(|(item, w)| PyWrittenChunk {
            key: item.key.clone(),
            region: item.region.clone(),
            file: file.path.clone(),
            file_size: file.size,
            offset: w.offset,
            nbytes: w.len,
            checksums: w.checksums,
            codec: codec_name(w.codec).to_string(),
            shuffle: match w.codec {
                core::Codec::Zstd { shuffle } => shuffle,
                core::Codec::Raw => 0,
            },
            block_lens: w.block_lens,
        })
        .collect())
}

/// One save into a checkpoint directory (`olmo_chunks._core.SaveTransaction`): takes the
/// directory's lease, hands out the save id data files go under, then commits or aborts.
#[pyclass(name = "SaveTransaction", module = "olmo_chunks._core", frozen)]
struct PySaveTransaction {
    inner: std::sync::Mutex<core::SaveTxn>,
    location: String,
    save_id: String,
}

#[pymethods]
impl PySaveTransaction {
    /// Takes the lease of the checkpoint at `path` (a directory, created if missing, or a URL)
    /// for a new save.
    #[staticmethod]
    #[pyo3(signature = (path, overwrite=false, lease_timeout=45.0))]
    fn begin(py: Python<'_>, path: PathBuf, overwrite: bool, lease_timeout: f64) -> PyResult<Self> {
        let lease_timeout =
            std::time::Duration::try_from_secs_f64(lease_timeout).map_err(|_| {
                to_pyerr(
                    py,
                    CoreError::InvalidArgument(format!("bad lease timeout {lease_timeout}")),
                )
            })?;
        let opts = core::SaveOptions {
            overwrite,
            lease_timeout,
        };
        let location = location(&path);
        let txn = detach(py, || core::begin_save(&location, opts))?;
        Ok(PySaveTransaction {
            save_id: txn.save_id().to_string(),
            inner: std::sync::Mutex::new(txn),
            location,
        })
    }

    #[getter]
    fn save_id(&self) -> &str {
        &self.save_id
    }

    /// Whether `commit` published the manifest (a `KeyboardInterrupt` may have come as it returned).
    #[getter]
    fn committed(&self) -> bool {
        self.inner.lock().unwrap().is_committed()
    }

    /// Raises `CheckpointLockedError` if another save took this one's lease over.
    fn check_lease(&self, py: Python<'_>) -> PyResult<()> {
        let inner = &self.inner;
        detach(py, || inner.lock().unwrap().check_lease())
    }

    /// Assembles the manifest from `tensors` (every tensor of the save) and `chunks` (what every
    /// rank wrote), checks it as every reader does (and exact coverage), commits it atomically and
    /// removes the data of the saves it supersedes. `ready()`, if given, is called last before
    /// the manifest is published; what it raises calls the commit off and is raised.
    #[pyo3(signature = (block_size, tensors, chunks, entries_json, info_json, ready=None))]
    #[allow(clippy::too_many_arguments)]
    fn commit(
        &self,
        py: Python<'_>,
        block_size: u64,
        tensors: Vec<PyRef<'_, PyTensorSchema>>,
        chunks: Vec<PyRef<'_, PyWrittenChunk>>,
        entries_json: &str,
        info_json: &str,
        ready: Option<Py<PyAny>>,
    ) -> PyResult<PyManifest> {
        let parse = |s: &str| {
            serde_json::from_str(s)
                .map_err(|e| to_pyerr(py, CoreError::InvalidArgument(format!("bad JSON: {e}"))))
        };
        let (entries, info) = (parse(entries_json)?, parse(info_json)?);
        let tensors: Vec<core::TensorSchema> = tensors
            .iter()
            .map(|t| core::TensorSchema {
                key: t.key.clone(),
                dtype: t.dtype.clone(),
                shape: t.shape.clone(),
                role: t.role.clone(),
            })
            .collect();
        let chunks = chunks
            .iter()
            .map(|c| c.to_core())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| to_pyerr(py, e))?;
        let raised: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);
        let ready = || match &ready {
            None => Ok(()),
            Some(f) => Python::attach(|py| f.call0(py)).map(drop).map_err(|e| {
                let why = format!("the commit was called off: {e}");
                *raised.lock().unwrap() = Some(e);
                CoreError::InvalidArgument(why)
            }),
        };
        let committed = detach(py, || {
            let m = self
                .inner
                .lock()
                .unwrap()
                .commit_parts(block_size, tensors, chunks, entries, info, &ready)?;
            Ok((m, core::storage_at(&self.location)?))
        });
        let (m, storage) = match (committed, raised.into_inner().unwrap()) {
            (Err(_), Some(e)) => return Err(e),
            (committed, _) => committed?,
        };
        Ok(PyManifest {
            inner: Arc::new(m),
            storage,
        })
    }

    /// Removes this save's data and releases the lease (the committed checkpoint is untouched).
    fn abort(&self, py: Python<'_>) {
        py.detach(|| self.inner.lock().unwrap().abort());
    }
}

/// A store call's I/O error as the Python builtin a caller expects: `TimeoutError` when the
/// server did not answer within the client's timeout, `ConnectionError` otherwise; this process's
/// own shortage of file descriptors or memory is a `StorageError` saying so (the store is fine).
fn store_err(e: std::io::Error) -> PyErr {
    if core::error::is_own_shortage(&e) {
        let why = format!(
            "could not reach the rendezvous store: {e}: this process is out of file descriptors \
             (ulimit -n), memory or threads"
        );
        return Python::attach(|py| {
            let source = std::io::Error::new(e.kind(), why);
            to_pyerr(
                py,
                CoreError::Io {
                    path: "olmo-chunks".into(),
                    source,
                },
            )
        });
    }
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            pyo3::exceptions::PyTimeoutError::new_err(format!(
                "the rendezvous store did not answer: {e}"
            ))
        }
        _ => {
            pyo3::exceptions::PyConnectionError::new_err(format!("lost the rendezvous store: {e}"))
        }
    }
}

fn seconds(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("bad duration {s} s")))
}

/// A connection of this process to torch.distributed's TCPStore (`olmo_chunks._core.StoreClient`):
/// every call releases the GIL and ends within `timeout` seconds (TimeoutError) or on a lost
/// connection (ConnectionError, and every later call too). `rtt` adds a delay per round trip
/// (benchmarks model a cluster with it).
#[pyclass(name = "StoreClient", module = "olmo_chunks._core", frozen)]
struct PyStoreClient {
    inner: std::sync::Mutex<Option<core::rendezvous::StoreClient>>,
    /// Queries of the connections this client has had (a lost one's are kept).
    requests: AtomicU64,
}

impl PyStoreClient {
    fn call<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut core::rendezvous::StoreClient) -> std::io::Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let mut guard = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            let client = guard.as_mut().ok_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotConnected, "an earlier call failed")
            })?;
            let before = client.requests();
            let out = f(client);
            self.requests
                .fetch_add(client.requests() - before, Ordering::Relaxed);
            if out.is_err() {
                *guard = None; // the stream may be mid-answer: never reuse it
            }
            out
        })
        .map_err(store_err)
    }
}

#[pymethods]
impl PyStoreClient {
    #[new]
    #[pyo3(signature = (host, port, timeout, rtt=0.0))]
    fn new(py: Python<'_>, host: String, port: u16, timeout: f64, rtt: f64) -> PyResult<Self> {
        let (timeout, rtt) = (seconds(timeout)?, seconds(rtt)?);
        let client = py
            .detach(|| core::rendezvous::StoreClient::connect(&host, port, timeout, rtt))
            .map_err(store_err)?;
        Ok(PyStoreClient {
            inner: std::sync::Mutex::new(Some(client)),
            requests: AtomicU64::new(0),
        })
    }

    /// Queries sent so far (a pipelined batch counts each of its queries).
    #[getter]
    fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Bounds every later call by `timeout` seconds instead (ConnectionError if the connection
    /// was lost).
    fn set_timeout(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds(timeout)?;
        self.call(py, |c| c.set_timeout(timeout))
    }

    fn set(&self, py: Python<'_>, key: &str, value: &[u8]) -> PyResult<()> {
        self.call(py, |c| c.set(key, value))
    }

    /// Sets `keys[i]` to `values[i]`, in one write.
    fn set_many(&self, py: Python<'_>, keys: Vec<String>, values: Vec<Vec<u8>>) -> PyResult<()> {
        let items: Vec<(&str, &[u8])> = keys
            .iter()
            .map(|k| k.as_str())
            .zip(values.iter().map(|v| v.as_slice()))
            .collect();
        self.call(py, |c| c.set_many(&items))
    }

    fn append(&self, py: Python<'_>, key: &str, value: &[u8]) -> PyResult<()> {
        self.call(py, |c| c.append(key, value))
    }

    /// The value of `key`, which must exist.
    fn get(&self, py: Python<'_>, key: &str) -> PyResult<Py<pyo3::types::PyBytes>> {
        let v = self.call(py, |c| c.get(key))?;
        Ok(pyo3::types::PyBytes::new(py, &v).unbind())
    }

    /// The values of `keys`, which must all exist.
    fn multi_get(
        &self,
        py: Python<'_>,
        keys: Vec<String>,
    ) -> PyResult<Vec<Py<pyo3::types::PyBytes>>> {
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        let vs = self.call(py, |c| c.multi_get(&refs))?;
        Ok(vs
            .iter()
            .map(|v| pyo3::types::PyBytes::new(py, v).unbind())
            .collect())
    }

    fn add(&self, py: Python<'_>, key: &str, delta: i64) -> PyResult<i64> {
        self.call(py, |c| c.add(key, delta))
    }

    fn check(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<bool> {
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        self.call(py, |c| c.check(&refs))
    }

    /// Deletes `keys`; returns how many existed.
    fn delete(&self, py: Python<'_>, keys: Vec<String>) -> PyResult<usize> {
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        self.call(py, |c| c.delete(&refs))
    }

    /// True once every key in `keys` exists, False after `timeout` seconds.
    fn wait(&self, py: Python<'_>, keys: Vec<String>, timeout: f64) -> PyResult<bool> {
        let refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
        let t = seconds(timeout)?;
        self.call(py, |c| c.wait(&refs, t))
    }
}

/// A native thread bumping `key` in the TCPStore at `host:port` every `interval` seconds
/// (`olmo_chunks._core.Heartbeat`); it runs while Python holds the GIL.
#[pyclass(name = "Heartbeat", module = "olmo_chunks._core", frozen)]
struct PyHeartbeat {
    inner: core::rendezvous::Heartbeat,
}

#[pymethods]
impl PyHeartbeat {
    #[new]
    fn new(
        py: Python<'_>,
        host: String,
        port: u16,
        key: String,
        interval: f64,
        timeout: f64,
    ) -> PyResult<Self> {
        let (interval, timeout) = (seconds(interval)?, seconds(timeout)?);
        let inner = py
            .detach(|| core::rendezvous::Heartbeat::start(&host, port, &key, interval, timeout))
            .map_err(store_err)?;
        Ok(PyHeartbeat { inner })
    }

    fn set_interval(&self, interval: f64) -> PyResult<()> {
        self.inner.set_interval(seconds(interval)?);
        Ok(())
    }

    #[getter]
    fn beats(&self) -> u64 {
        self.inner.beats()
    }

    /// Seconds: the longest this process went without a beat landing, of the silences that ended
    /// within the last `within` seconds or go on now.
    fn longest_silence(&self, within: f64) -> f64 {
        let within = Duration::try_from_secs_f64(within).unwrap_or(Duration::MAX);
        self.inner.longest_silence(within).as_secs_f64()
    }

    fn stop(&self, py: Python<'_>) {
        py.detach(|| self.inner.stop());
    }
}

fn codec_name(c: core::Codec) -> &'static str {
    match c {
        core::Codec::Raw => "raw",
        core::Codec::Zstd { .. } => "zstd",
    }
}

/// Uploads object `rel` of `size` bytes at `url` with object_store alone, `concurrency` parts in
/// flight: the benchmark's roofline for saves.
#[pyfunction]
fn object_store_put_raw(
    py: Python<'_>,
    url: &str,
    rel: &str,
    size: u64,
    concurrency: usize,
) -> PyResult<()> {
    detach(py, || {
        core::object::ObjectStorage::open(url)?.raw_put(rel, size, concurrency)
    })
}

/// Reads `(rel, offset, len)` ranges at `url` with object_store alone, `concurrency` ranged GETs
/// in flight; returns the bytes read: the benchmark's roofline for loads.
#[pyfunction]
fn object_store_get_raw(
    py: Python<'_>,
    url: &str,
    ranges: Vec<(String, u64, u64)>,
    concurrency: usize,
) -> PyResult<u64> {
    detach(py, || {
        core::object::ObjectStorage::open(url)?.raw_get(&ranges, concurrency)
    })
}

/// What this process moved to and from the bucket of URL `url`: `(bytes_read, bytes_written,
/// requests)` (requests sent, retries of one not counted).
#[pyfunction]
fn object_store_counters(py: Python<'_>, url: &str) -> PyResult<(u64, u64, u64)> {
    let c = core::object::bucket_counters(url).map_err(|e| to_pyerr(py, e))?;
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    Ok((get(&c.read), get(&c.written), get(&c.requests)))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyManifest>()?;
    m.add_function(wrap_pyfunction!(write_chunks, m)?)?;
    m.add_class::<PySaveTransaction>()?;
    m.add_class::<PyTensorSchema>()?;
    m.add_class::<PyWrittenChunk>()?;
    m.add_class::<PyFileInfo>()?;
    m.add_class::<PyTensorInfo>()?;
    m.add_class::<PyChunkInfo>()?;
    m.add_class::<PyBox>()?;
    m.add_class::<PyFlat>()?;
    m.add_class::<PyPiece>()?;
    m.add_class::<PyTarget>()?;
    m.add_class::<PyRun>()?;
    m.add_class::<PyOverlap>()?;
    m.add_class::<PyRoundBytes>()?;
    m.add_class::<PyWriteItem>()?;
    m.add_class::<PyRates>()?;
    m.add_class::<PyReadChoice>()?;
    m.add_function(wrap_pyfunction!(flat_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(box_runs, m)?)?;
    m.add_function(wrap_pyfunction!(box_overlaps, m)?)?;
    m.add_class::<PyReadOnce>()?;
    m.add_class::<PyStoreClient>()?;
    m.add_class::<PyHeartbeat>()?;
    m.add_function(wrap_pyfunction!(plan_read_once, m)?)?;
    m.add_function(wrap_pyfunction!(blocks_shared, m)?)?;
    m.add_function(wrap_pyfunction!(check_shares, m)?)?;
    m.add_function(wrap_pyfunction!(io_counters, m)?)?;
    m.add_function(wrap_pyfunction!(assign_writers, m)?)?;
    m.add_function(wrap_pyfunction!(check_storage, m)?)?;
    m.add_function(wrap_pyfunction!(data_file, m)?)?;
    m.add_function(wrap_pyfunction!(open_beneath, m)?)?;
    m.add_function(wrap_pyfunction!(set_read_pace, m)?)?;
    m.add_function(wrap_pyfunction!(pace_read, m)?)?;
    m.add_function(wrap_pyfunction!(read_pace, m)?)?;
    m.add_function(wrap_pyfunction!(object_store_counters, m)?)?;
    m.add_function(wrap_pyfunction!(object_store_put_raw, m)?)?;
    m.add_function(wrap_pyfunction!(object_store_get_raw, m)?)?;
    m.add("FORMAT_VERSION", core::FORMAT_VERSION)?;
    m.add("MANIFEST_NAME", core::MANIFEST_NAME)?;
    m.add("DEFAULT_BLOCK_SIZE", core::manifest::DEFAULT_BLOCK_SIZE)?;
    let dtypes: Vec<&str> = core::dtype::DTYPES.iter().map(|&(name, _)| name).collect();
    m.add("DTYPES", dtypes)?;
    Ok(())
}
