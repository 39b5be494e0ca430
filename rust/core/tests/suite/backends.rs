//! The backend suite (`olmo_chunks_core::conformance`) on the backends a test can make here: a
//! local directory and an in-memory object store. pytest runs it on the S3 server it starts.

use std::sync::Arc;

use olmo_chunks_core::conformance::check;
use olmo_chunks_core::object::ObjectStorage;
use olmo_chunks_core::LocalFs;

#[test]
fn a_local_directory_conforms() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        check(Arc::new(LocalFs::new(dir.path()))),
        Vec::<String>::new()
    );
}

#[test]
fn an_in_memory_object_store_conforms() {
    let store = ObjectStorage::in_memory(1 << 20).unwrap();
    assert_eq!(check(Arc::new(store)), Vec::<String>::new());
}
