//! The buffered wire of one connection: a read buffer the requests are decoded from in place,
//! and the output buffer replies are appended to and written out in batches.

use super::*;

/// Buffered reads and writes over one transport.
pub(super) struct Wire<T> {
    pub(super) t: T,
    pub(super) rbuf: Box<[u8]>,
    pub(super) rpos: usize,
    pub(super) rend: usize,
    pub(super) out: Vec<u8>,
}

impl<T: Transport> Wire<T> {
    pub(super) fn new(t: T, read_buffer_bytes: usize) -> Self {
        Self {
            t,
            rbuf: vec![0u8; read_buffer_bytes].into_boxed_slice(),
            rpos: 0,
            rend: 0,
            out: Vec::new(),
        }
    }

    pub(super) fn buffered(&self) -> usize {
        self.rend - self.rpos
    }

    pub(super) fn take_buffered(&mut self, dst: &mut [u8]) -> usize {
        let n = self.buffered().min(dst.len());
        dst[..n].copy_from_slice(&self.rbuf[self.rpos..self.rpos + n]);
        self.rpos += n;
        n
    }

    pub(super) fn fill(&mut self) -> io::Result<()> {
        self.rpos = 0;
        self.rend = 0;
        let n = read_some(&mut self.t, &mut self.rbuf)?;
        self.rend = n;
        Ok(())
    }

    pub(super) fn read_exact(&mut self, dst: &mut [u8]) -> io::Result<()> {
        let mut filled = self.take_buffered(dst);
        while filled < dst.len() {
            if dst.len() - filled >= self.rbuf.len() {
                filled += read_some(&mut self.t, &mut dst[filled..])?;
            } else {
                self.fill()?;
                filled += self.take_buffered(&mut dst[filled..]);
            }
        }
        Ok(())
    }

    pub(super) fn discard(&mut self, len_bytes: u64) -> io::Result<()> {
        let mut left = len_bytes;
        loop {
            let n = (self.buffered() as u64).min(left);
            // n <= buffered(), a usize.
            self.rpos += n as usize;
            left -= n;
            if left == 0 {
                return Ok(());
            }
            self.fill()?;
        }
    }

    pub(super) fn flush(&mut self) -> io::Result<()> {
        if !self.out.is_empty() {
            self.t.write_all(&self.out)?;
            self.out.clear();
        }
        self.t.flush()?;
        self.t.end_replies()
    }

    /// Writes out pending replies if `more` bytes would push the buffer past its flush size.
    pub(super) fn make_room(&mut self, more: usize) -> io::Result<()> {
        if !self.out.is_empty() && self.out.len() + more > OUT_FLUSH_BYTES {
            self.flush()?;
        }
        Ok(())
    }
}

/// One `read`, retrying `EINTR`; zero bytes is `UnexpectedEof`.
pub(super) fn read_some(t: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    loop {
        match t.read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

pub(super) fn is_eof(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe
    )
}
