//! The typed records the bindings take and return: a chunk's region (`Box` or `Flat`), a load
//! target's pieces, the element runs and box overlaps of a plan, and a chunk to write. Each is a
//! frozen class with named fields, so no call site spells a record as a tuple or a kind string.

use std::collections::BTreeMap;

use olmo_chunks_core::{CoreError, Piece, Region};
use pyo3::prelude::*;
use pyo3::types::PyTuple;

fn bad(why: String) -> PyErr {
    Python::attach(|py| crate::to_pyerr(py, CoreError::InvalidArgument(why)))
}

/// `sizes[i]` elements from `offsets[i]` in each dimension of a tensor, stored row-major in the
/// box's own shape.
#[pyclass(
    name = "Box",
    module = "olmo_chunks._core",
    frozen,
    get_all,
    eq,
    hash,
    from_py_object
)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyBox {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

#[pymethods]
impl PyBox {
    #[new]
    fn new(offsets: Vec<u64>, sizes: Vec<u64>) -> PyResult<Self> {
        if offsets.len() != sizes.len() {
            return Err(bad(format!(
                "a box has as many offsets as sizes, got {offsets:?} and {sizes:?}"
            )));
        }
        Ok(PyBox { offsets, sizes })
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let b = slf.get();
        (slf.get_type(), (b.offsets.clone(), b.sizes.clone())).into_pyobject(slf.py())
    }
    fn __repr__(&self) -> String {
        format!("Box(offsets={:?}, sizes={:?})", self.offsets, self.sizes)
    }
}

/// Elements `start .. start + len` of a tensor's row-major order, stored in that order.
#[pyclass(
    name = "Flat",
    module = "olmo_chunks._core",
    frozen,
    get_all,
    eq,
    hash,
    from_py_object
)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyFlat {
    pub start: u64,
    pub len: u64,
}

#[pymethods]
impl PyFlat {
    #[new]
    fn new(start: u64, len: u64) -> Self {
        PyFlat { start, len }
    }
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let f = slf.get();
        (slf.get_type(), (f.start, f.len)).into_pyobject(slf.py())
    }
    fn __repr__(&self) -> String {
        format!("Flat(start={}, len={})", self.start, self.len)
    }
}

/// A region argument: a `Box` or a `Flat`.
#[derive(FromPyObject)]
pub enum RegionArg {
    Box(PyBox),
    Flat(PyFlat),
}

impl From<RegionArg> for Region {
    fn from(r: RegionArg) -> Region {
        match r {
            RegionArg::Box(PyBox { offsets, sizes }) => Region::Box { offsets, sizes },
            RegionArg::Flat(PyFlat { start, len }) => Region::Flat { start, len },
        }
    }
}

/// `r` as the Python record of its kind.
pub fn region_py(py: Python<'_>, r: &Region) -> PyResult<Py<PyAny>> {
    Ok(match r {
        Region::Box { offsets, sizes } => PyBox {
            offsets: offsets.clone(),
            sizes: sizes.clone(),
        }
        .into_pyobject(py)?
        .into_any()
        .unbind(),
        Region::Flat { start, len } => PyFlat {
            start: *start,
            len: *len,
        }
        .into_pyobject(py)?
        .into_any()
        .unbind(),
    })
}

/// A box of a global tensor and its affine map to element offsets of a local buffer: global
/// element `offsets + i` lies at `local_start + sum(i[d] * strides[d])`.
#[pyclass(
    name = "Piece",
    module = "olmo_chunks._core",
    frozen,
    get_all,
    eq,
    from_py_object
)]
#[derive(Clone, PartialEq)]
pub struct PyPiece {
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
    pub local_start: u64,
    pub strides: Vec<u64>,
}

#[pymethods]
impl PyPiece {
    #[new]
    fn new(
        offsets: Vec<u64>,
        sizes: Vec<u64>,
        local_start: u64,
        strides: Vec<u64>,
    ) -> PyResult<Self> {
        if offsets.len() != sizes.len() || sizes.len() != strides.len() {
            return Err(bad(format!(
                "a piece has as many offsets, sizes and strides, got {offsets:?}, {sizes:?} and {strides:?}"
            )));
        }
        Ok(PyPiece {
            offsets,
            sizes,
            local_start,
            strides,
        })
    }
    /// This piece in a buffer whose first element is `by` elements earlier.
    fn shifted(&self, by: u64) -> Self {
        PyPiece {
            local_start: self.local_start + by,
            ..self.clone()
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "Piece(offsets={:?}, sizes={:?}, local_start={}, strides={:?})",
            self.offsets, self.sizes, self.local_start, self.strides
        )
    }
}

impl From<Piece> for PyPiece {
    fn from(p: Piece) -> Self {
        PyPiece {
            offsets: p.offsets,
            sizes: p.sizes,
            local_start: p.local_start,
            strides: p.strides,
        }
    }
}

impl From<&PyPiece> for Piece {
    fn from(p: &PyPiece) -> Self {
        Piece {
            offsets: p.offsets.clone(),
            sizes: p.sizes.clone(),
            local_start: p.local_start,
            strides: p.strides.clone(),
        }
    }
}

/// What a load fills: the elements of manifest tensor `tensor` that `pieces` name, in buffer
/// `buffer` (an index into the buffers of the call).
#[pyclass(name = "Target", module = "olmo_chunks._core", frozen, get_all)]
pub struct PyTarget {
    pub tensor: usize,
    pub pieces: Vec<PyPiece>,
    pub buffer: usize,
}

#[pymethods]
impl PyTarget {
    #[new]
    #[pyo3(signature = (tensor, pieces, buffer=0))]
    fn new(tensor: usize, pieces: Vec<PyPiece>, buffer: usize) -> Self {
        PyTarget {
            tensor,
            pieces,
            buffer,
        }
    }
    fn __repr__(&self) -> String {
        format!(
            "Target(tensor={}, {} pieces, buffer={})",
            self.tensor,
            self.pieces.len(),
            self.buffer
        )
    }
}

/// `len` elements copied from element `src` of chunk `chunk` (its index among its tensor's
/// chunks) to element `dst` of target `target`.
#[pyclass(name = "Run", module = "olmo_chunks._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PyRun {
    pub chunk: usize,
    pub src: u64,
    pub target: usize,
    pub dst: u64,
    pub len: u64,
}

#[pymethods]
impl PyRun {
    fn __repr__(&self) -> String {
        format!(
            "Run(chunk={}, src={}, target={}, dst={}, len={})",
            self.chunk, self.src, self.target, self.dst, self.len
        )
    }
}

/// The non-empty intersection (`offsets`, `sizes`) of saved box `saved` (at `saved_offsets`) and
/// wanted box `wanted`.
#[pyclass(name = "Overlap", module = "olmo_chunks._core", frozen, get_all, eq)]
#[derive(PartialEq)]
pub struct PyOverlap {
    pub saved: usize,
    pub wanted: usize,
    pub saved_offsets: Vec<u64>,
    pub offsets: Vec<u64>,
    pub sizes: Vec<u64>,
}

impl PyOverlap {
    pub fn new(o: olmo_chunks_core::plan::Overlap, saved_offsets: Vec<u64>) -> Self {
        PyOverlap {
            saved: o.saved,
            wanted: o.wanted,
            saved_offsets,
            offsets: o.offsets,
            sizes: o.sizes,
        }
    }
}

#[pymethods]
impl PyOverlap {
    fn __repr__(&self) -> String {
        format!(
            "Overlap(saved={}, wanted={}, saved_offsets={:?}, offsets={:?}, sizes={:?})",
            self.saved, self.wanted, self.saved_offsets, self.offsets, self.sizes
        )
    }
}

/// The bytes of one read-once round: read from storage, and sent to and received from each peer.
#[pyclass(name = "RoundBytes", module = "olmo_chunks._core", frozen, get_all)]
pub struct PyRoundBytes {
    pub read: u64,
    pub sends: BTreeMap<u32, u64>,
    pub recvs: BTreeMap<u32, u64>,
}

#[pymethods]
impl PyRoundBytes {
    /// Sent and received bytes together: what the round stages (what it reads for this rank goes
    /// straight into place).
    #[getter]
    fn total(&self) -> u64 {
        self.sends.values().sum::<u64>() + self.recvs.values().sum::<u64>()
    }
    fn __repr__(&self) -> String {
        format!(
            "RoundBytes(read={}, sends={:?}, recvs={:?})",
            self.read, self.sends, self.recvs
        )
    }
}

/// A chunk to write: region `region` of tensor `key`, its `nbytes` bytes at `address` of live,
/// contiguous CPU memory.
#[pyclass(name = "WriteItem", module = "olmo_chunks._core", frozen)]
pub struct PyWriteItem {
    #[pyo3(get)]
    pub key: String,
    pub region: Region,
    #[pyo3(get)]
    pub address: usize,
    #[pyo3(get)]
    pub nbytes: usize,
}

#[pymethods]
impl PyWriteItem {
    #[new]
    fn new(key: String, region: RegionArg, address: usize, nbytes: usize) -> Self {
        PyWriteItem {
            key,
            region: region.into(),
            address,
            nbytes,
        }
    }
    #[getter]
    fn region(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        region_py(py, &self.region)
    }
}

/// What a load's time is predicted from (`core::coop::Rates`): bytes per second one rank reads
/// from storage, moves in an all-to-all and copies through fresh buffers, and the fixed seconds
/// of a read-once round.
#[pyclass(name = "Rates", module = "olmo_chunks._core", frozen, get_all)]
pub struct PyRates {
    pub storage: f64,
    pub exchange: f64,
    pub round: f64,
    pub copy: f64,
}

#[pymethods]
impl PyRates {
    #[new]
    fn new(storage: f64, exchange: f64, round: f64, copy: f64) -> PyResult<Self> {
        // An exchange and copies that cost nothing (infinite rates) bound what reading once can
        // gain; storage and a round's seconds are finite.
        let positive = |x: f64| x > 0.0; // false for NaN
        if !(positive(storage)
            && storage.is_finite()
            && positive(exchange)
            && positive(copy)
            && round.is_finite()
            && round >= 0.0)
        {
            return Err(bad(format!(
                "rates must be positive (storage finite, exchange and copy possibly infinite) and \
                 a round's seconds finite and not negative, got storage {storage}, exchange \
                 {exchange}, round {round}, copy {copy}"
            )));
        }
        Ok(PyRates {
            storage,
            exchange,
            round,
            copy,
        })
    }
    fn __repr__(&self) -> String {
        format!(
            "Rates(storage={}, exchange={}, round={}, copy={})",
            self.storage, self.exchange, self.round, self.copy
        )
    }
}

impl PyRates {
    pub fn inner(&self) -> olmo_chunks_core::coop::Rates {
        olmo_chunks_core::coop::Rates {
            storage: self.storage,
            exchange: self.exchange,
            round: self.round,
            copy: self.copy,
        }
    }
}

/// `plan_read_once`'s answer: the ranks' plans, or `None` when each rank reads its own, and the
/// predicted seconds of reading directly and once (`None` without rates). Read directly with
/// `hosts` given, `trusted` has each rank's blocks that another rank of its host checks, or that
/// its ranks check in part (the argument `ReadOnce.load` takes), and `split_sum` what the ranks'
/// shares of the latter XOR to when every byte is as saved (`core::coop::split_sum`).
#[pyclass(name = "ReadChoice", module = "olmo_chunks._core", frozen, get_all)]
pub struct PyReadChoice {
    pub plans: Option<Vec<Py<pyo3::types::PyBytes>>>,
    pub direct_s: Option<f64>,
    pub once_s: Option<f64>,
    pub trusted: Option<Vec<Py<pyo3::types::PyBytes>>>,
    pub split_sum: Option<u32>,
}
