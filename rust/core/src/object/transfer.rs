//! Data objects: ranged reads, and uploads in parts as the writers fill them.

use std::sync::Mutex;

use futures_util::StreamExt;
use object_store::multipart::PartId;
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, GetRange, ObjectStoreExt, PutPayload};

use super::storage::{to_io, ObjectStorage};
use crate::storage::Object;

pub(super) struct RemoteReader {
    pub(super) storage: ObjectStorage,
    pub(super) key: ObjectPath,
    pub(super) size: u64,
}

impl Object for RemoteReader {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_exact_at(&self, bufs: &mut [&mut [u8]], offset: u64) -> std::io::Result<()> {
        self.read_exact_at_seen(bufs, offset, &mut |_| {})
    }

    /// One ranged GET, its body copied into `bufs` as it arrives (each piece handed to `seen`
    /// right after its copy).
    fn read_exact_at_seen(
        &self,
        bufs: &mut [&mut [u8]],
        offset: u64,
        seen: &mut dyn FnMut(&[u8]),
    ) -> std::io::Result<()> {
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
                    seen(head);
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
pub(super) struct Part {
    buf: Vec<u8>,
    filled: u64,
    uploaded: Option<PartId>,
}

/// A data object being written: parts of `part` bytes filled by the writers and uploaded by the
/// writer that completes each (a file of one part is uploaded whole by `sync`).
pub(super) struct RemoteWriter {
    pub(super) storage: ObjectStorage,
    pub(super) key: ObjectPath,
    /// Where the upload's id is recorded while it is in progress.
    pub(super) marker: ObjectPath,
    pub(super) size: u64,
    pub(super) part: u64,
    /// The multipart upload, until it completes or is aborted.
    pub(super) upload: Mutex<Option<String>>,
    pub(super) parts: Vec<Mutex<Part>>,
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
        self.forget_upload();
        Ok(())
    }
}

impl RemoteWriter {
    /// Removes the upload's marker (best effort: a marker whose upload is gone only costs the
    /// cleanup an abort that finds nothing).
    fn forget_upload(&self) {
        let s = &self.storage;
        let _ = s.block_on(s.bucket.store.delete(&self.marker));
    }
}

impl Drop for RemoteWriter {
    /// Abandons an upload that never completed. A killed writer's is aborted by the cleanup of a
    /// later save, from its marker.
    fn drop(&mut self) {
        if let Some(id) = self.upload.lock().unwrap().take() {
            let s = &self.storage;
            if s.block_on(s.bucket.multipart.abort_multipart(&self.key, &id))
                .is_ok()
            {
                self.forget_upload();
            }
        }
    }
}
