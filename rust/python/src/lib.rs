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

/// Maps a core error onto the Python exception hierarchy in `olmo_chunks.errors`.
fn to_pyerr(py: Python<'_>, e: CoreError) -> PyErr {
    let msg = e.to_string();
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

fn region_from_py(kind: &str, a: Vec<u64>, b: Vec<u64>) -> Result<Region, CoreError> {
    match (kind, a.as_slice(), b.as_slice()) {
        ("box", _, _) => Ok(Region::Box {
            offsets: a,
            sizes: b,
        }),
        ("flat", [start], [len]) => Ok(Region::Flat {
            start: *start,
            len: *len,
        }),
        _ => Err(CoreError::InvalidArgument(format!(
            "bad region {kind:?} {a:?} {b:?}"
        ))),
    }
}

type PyPiece = (Vec<u64>, Vec<u64>, u64, Vec<u64>);
/// `(chunk_in_tensor, src_elem, target, dst_elem, len)`
type PyRun = (usize, u64, usize, u64, u64);
/// `(key, kind, a, b, address, nbytes)`: a chunk to write, from live memory.
type PyWriteItem = (String, String, Vec<u64>, Vec<u64>, usize, usize);

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

    #[getter]
    fn format_version(&self) -> u32 {
        core::FORMAT_VERSION
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
    /// Each saved chunk of tensor `t`: kind "box" with offsets/sizes, or "flat" with
    /// `[start]`/`[len]`, and where its bytes lie.
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
            .map(|c| {
                let (kind, offsets, sizes) = match &c.region {
                    Region::Box { offsets, sizes } => ("box", offsets.clone(), sizes.clone()),
                    Region::Flat { start, len } => ("flat", vec![*start], vec![*len]),
                };
                PyChunkInfo {
                    kind: kind.to_string(),
                    offsets,
                    sizes,
                    file: c.file,
                    offset: c.offset,
                    nbytes: c.len,
                }
            })
            .collect())
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
            let job = s.spawn(|| {
                let r = core::verify_from(&*storage, &m, workers, Some(&done));
                caller.unpark();
                r
            });
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
    /// Element runs `(chunk_in_tensor, src_elem, target, dst_elem, len)` filling each target.
    /// A target is `(tensor_index, pieces)`, a piece `(offsets, sizes, local_start, strides)`.
    fn plan_runs(
        &self,
        py: Python<'_>,
        targets: Vec<(usize, Vec<PyPiece>)>,
    ) -> PyResult<Vec<PyRun>> {
        let m = self.inner.clone();
        let targets: Vec<core::Target> = targets
            .into_iter()
            .enumerate()
            .map(|(i, (tensor, pieces))| core::Target {
                tensor,
                pieces: pieces.into_iter().map(piece).collect(),
                dest: i,
                dest_len: u64::MAX,
            })
            .collect();
        detach(py, move || {
            let runs = core::plan_runs(&m, &targets)?;
            Ok(runs
                .into_iter()
                .map(|r| {
                    (
                        r.src - m.chunk_start[targets[r.dst].tensor],
                        r.src_elem,
                        r.dst,
                        r.dst_elem,
                        r.len,
                    )
                })
                .collect())
        })
    }
    /// Fills destination buffers from the checkpoint. `targets` are `(tensor_index, pieces,
    /// buffer_index)`; `buffers` are `(address, nbytes)` of live CPU memory.
    #[pyo3(signature = (targets, buffers, verify=true, workers=None))]
    fn load(
        &self,
        py: Python<'_>,
        targets: Vec<(usize, Vec<PyPiece>, usize)>,
        buffers: Vec<(usize, usize)>,
        verify: bool,
        workers: Option<usize>,
    ) -> PyResult<()> {
        let (m, storage) = (self.inner.clone(), self.storage.clone());
        let mut ts = Vec::with_capacity(targets.len());
        for (tensor, pieces, dest) in targets {
            let Some(&(_, dest_len)) = buffers.get(dest) else {
                return Err(to_pyerr(
                    py,
                    CoreError::InvalidArgument(format!("buffer index {dest} out of range")),
                ));
            };
            ts.push(core::Target {
                tensor,
                pieces: pieces.into_iter().map(piece).collect(),
                dest,
                dest_len: dest_len as u64,
            });
        }
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

fn piece((offsets, sizes, local_start, strides): PyPiece) -> Piece {
    Piece {
        offsets,
        sizes,
        local_start,
        strides,
    }
}

/// Pieces `(offsets, sizes, local_start, strides)` of the flat range `[start, start + len)` of a
/// tensor of `shape`, with local offsets counted from `start`.
#[pyfunction]
fn flat_pieces(py: Python<'_>, shape: Vec<u64>, start: u64, len: u64) -> PyResult<Vec<PyPiece>> {
    let r = Region::Flat { start, len };
    r.check_bounds(&shape)
        .map_err(|why| to_pyerr(py, CoreError::InvalidArgument(why)))?;
    Ok(r.pieces(&shape)
        .into_iter()
        .map(|p| (p.offsets, p.sizes, p.local_start, p.strides))
        .collect())
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

type PyBox = (Vec<u64>, Vec<u64>);

/// Overlaps of saved and wanted boxes, one tensor per item of `tensors` (`(ndim, saved, wanted)`):
/// per tensor, `(saved_index, wanted_index, offsets, sizes)` for every non-empty overlap, wanted
/// box by wanted box, saved boxes ascending.
#[pyfunction]
#[allow(clippy::type_complexity)]
fn box_overlaps(
    py: Python<'_>,
    tensors: Vec<(usize, Vec<PyBox>, Vec<PyBox>)>,
) -> PyResult<Vec<Vec<(usize, usize, Vec<u64>, Vec<u64>)>>> {
    detach(py, move || {
        tensors
            .iter()
            .map(|(ndim, saved, wanted)| {
                Ok(core::box_overlaps(*ndim, saved, wanted)?
                    .into_iter()
                    .map(|o| (o.saved, o.wanted, o.offsets, o.sizes))
                    .collect())
            })
            .collect()
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
}

#[pymethods]
impl PyTensorInfo {
    #[new]
    fn new(
        key: String,
        dtype: String,
        shape: Vec<u64>,
        role: String,
        chunks: usize,
        nbytes: u64,
    ) -> Self {
        PyTensorInfo {
            key,
            dtype,
            shape,
            role,
            chunks,
            nbytes,
        }
    }
    fn __eq__(&self, other: &Self) -> bool {
        self == other
    }
    fn __repr__(&self) -> String {
        format!(
            "TensorInfo(key={:?}, dtype={:?}, shape={:?}, role={:?}, chunks={}, nbytes={})",
            self.key, self.dtype, self.shape, self.role, self.chunks, self.nbytes
        )
    }
}

/// A saved chunk of a tensor (`Manifest.chunks(t)`): its region (`kind` "box" with
/// `offsets`/`sizes`, or "flat" with `[start]`/`[len]`), and `nbytes` bytes at `offset` of data
/// file `file` (an index into `Manifest.files`).
#[pyclass(name = "ChunkInfo", module = "olmo_chunks._core", frozen, get_all)]
#[derive(Clone, PartialEq)]
struct PyChunkInfo {
    kind: String,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    file: u32,
    offset: u64,
    nbytes: u64,
}

#[pymethods]
impl PyChunkInfo {
    #[new]
    fn new(
        kind: String,
        offsets: Vec<u64>,
        sizes: Vec<u64>,
        file: u32,
        offset: u64,
        nbytes: u64,
    ) -> Self {
        PyChunkInfo {
            kind,
            offsets,
            sizes,
            file,
            offset,
            nbytes,
        }
    }
    fn __eq__(&self, other: &Self) -> bool {
        self == other
    }
    fn __repr__(&self) -> String {
        format!(
            "ChunkInfo(kind={:?}, offsets={:?}, sizes={:?}, file={}, offset={}, nbytes={})",
            self.kind, self.offsets, self.sizes, self.file, self.offset, self.nbytes
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

/// One chunk a rank wrote (`olmo_chunks._core.WrittenChunk`): its region of tensor `key` (`kind`
/// "box" with `offsets`/`sizes`, or "flat" with `[start]`/`[len]`) and where its bytes lie.
/// Picklable: ranks send these to the rank that commits.
#[pyclass(name = "WrittenChunk", module = "olmo_chunks._core", frozen, get_all)]
#[derive(Clone)]
struct PyWrittenChunk {
    key: String,
    kind: String,
    offsets: Vec<u64>,
    sizes: Vec<u64>,
    file: String,
    file_size: u64,
    offset: u64,
    nbytes: u64,
    checksums: Vec<u32>,
}

#[pymethods]
impl PyWrittenChunk {
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        key: String,
        kind: String,
        offsets: Vec<u64>,
        sizes: Vec<u64>,
        file: String,
        file_size: u64,
        offset: u64,
        nbytes: u64,
        checksums: Vec<u32>,
    ) -> Self {
        PyWrittenChunk {
            key,
            kind,
            offsets,
            sizes,
            file,
            file_size,
            offset,
            nbytes,
            checksums,
        }
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let c = slf.get().clone();
        let args = (
            c.key,
            c.kind,
            c.offsets,
            c.sizes,
            c.file,
            c.file_size,
            c.offset,
            c.nbytes,
            c.checksums,
        );
        (slf.get_type(), args).into_pyobject(slf.py())
    }
    fn __repr__(&self) -> String {
        format!(
            "WrittenChunk(key={:?}, {} {:?}+{:?}, file={:?}, offset={}, nbytes={})",
            self.key, self.kind, self.offsets, self.sizes, self.file, self.offset, self.nbytes
        )
    }
}

impl PyWrittenChunk {
    fn to_core(&self) -> Result<core::SavedChunk, CoreError> {
        Ok(core::SavedChunk {
            key: self.key.clone(),
            region: region_from_py(&self.kind, self.offsets.clone(), self.sizes.clone())?,
            file: self.file.clone(),
            file_size: self.file_size,
            offset: self.offset,
            len: self.nbytes,
            checksums: self.checksums.clone(),
        })
    }
}

/// Writes one fresh data file `rel_path` under `dir` (a directory or URL) holding `items` (`(key, kind, a, b,
/// address, nbytes)`: the chunk's region of tensor `key` and its bytes in live memory), fsyncs it
/// and its directories, and returns a `WrittenChunk` per item.
#[pyfunction]
#[pyo3(signature = (dir, rel_path, items, block_size, workers=None))]
fn write_chunks(
    py: Python<'_>,
    dir: PathBuf,
    rel_path: String,
    items: Vec<PyWriteItem>,
    block_size: u64,
    workers: Option<usize>,
) -> PyResult<Vec<PyWrittenChunk>> {
    let datas: Vec<&[u8]> = items
        .iter()
        .map(|&(_, _, _, _, ptr, len)| {
            if len == 0 {
                return &[][..];
            }
            // SAFETY: the Python caller passes `data_ptr()` and byte size of live contiguous CPU
            // tensors that it keeps referenced and unmodified for the whole call; we only read.
            unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
        })
        .collect();
    let rel = vec![rel_path];
    let (written, files) = detach(py, || {
        let items: Vec<core::WriteItem<'_>> = datas
            .iter()
            .map(|&data| core::WriteItem { file: 0, data })
            .collect();
        let storage = core::storage_at(&location(&dir))?;
        core::write_chunks_to(&*storage, &rel, &items, block_size, worker_count(workers))
    })?;
    let file = &files[0];
    Ok(items
        .into_iter()
        .zip(written)
        .map(|((key, kind, offsets, sizes, _, _), w)| PyWrittenChunk {
            key,
            kind,
            offsets,
            sizes,
            file: file.path.clone(),
            file_size: file.size,
            offset: w.offset,
            nbytes: w.len,
            checksums: w.checksums,
        })
        .collect())
}

/// One save into a checkpoint directory (`olmo_chunks._core.SaveTransaction`): takes the
/// directory's lease, hands out the save id data files go under, then commits or aborts.
#[pyclass(name = "SaveTransaction", module = "olmo_chunks._core", frozen)]
struct PySaveTransaction {
    inner: std::sync::Mutex<Box<dyn core::Transaction>>,
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

    /// Assembles the manifest from `tensors` (every tensor of the save) and `chunks` (what every
    /// rank wrote), checks it as every reader does (and exact coverage), commits it atomically and
    /// removes the data of the saves it supersedes.
    fn commit(
        &self,
        py: Python<'_>,
        block_size: u64,
        tensors: Vec<PyRef<'_, PyTensorSchema>>,
        chunks: Vec<PyRef<'_, PyWrittenChunk>>,
        entries_json: &str,
        info_json: &str,
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
        let (m, storage) = detach(py, || {
            let m = self
                .inner
                .lock()
                .unwrap()
                .commit_parts(block_size, tensors, chunks, entries, info)?;
            Ok((m, core::storage_at(&self.location)?))
        })?;
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
    m.add_function(wrap_pyfunction!(flat_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(box_runs, m)?)?;
    m.add_function(wrap_pyfunction!(box_overlaps, m)?)?;
    m.add_function(wrap_pyfunction!(object_store_counters, m)?)?;
    m.add("FORMAT_VERSION", core::FORMAT_VERSION)?;
    m.add("MANIFEST_NAME", core::MANIFEST_NAME)?;
    m.add("DEFAULT_BLOCK_SIZE", core::manifest::DEFAULT_BLOCK_SIZE)?;
    Ok(())
}
