//! Input files the tools read: regular files only, opened without blocking.
//!
//! A FIFO given as a model blocks `open(2)` until some process opens it for writing,
//! and a device such as `/dev/zero` never ends, so a tool reading either hangs or
//! grows until memory runs out. Every model, tokenizer, checkpoint and importance-matrix
//! file is opened here: with `O_NONBLOCK` (a FIFO's open then returns at once), then
//! `fstat`, and anything that is not a regular file is refused with an error saying
//! what it is; the flag is cleared before the file is read. (Prompt text read with
//! `mlb-run --file` may come from a pipe and is not opened here.)

use std::fs::{File, FileType};
use std::io::{self, Read};
use std::path::Path;

/// What kind of file `t` is, for an error message ("a FIFO").
pub fn kind_name(t: &FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a folder"
    } else if t.is_file() {
        "a regular file"
    } else {
        "not a file"
    }
}

/// The error for an input that is not a regular file.
fn not_regular(t: &FileType) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("not a regular file ({})", kind_name(t)),
    )
}

/// Opens `path` for reading if it is a regular file (following symlinks); refuses a
/// FIFO, device, socket or folder without blocking on it.
pub fn open(path: &Path) -> io::Result<File> {
    #[cfg(unix)]
    let file = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)?
    };
    #[cfg(not(unix))]
    let file = File::open(path)?;
    let t = file.metadata()?.file_type();
    if !t.is_file() {
        return Err(not_regular(&t));
    }
    #[cfg(unix)]
    {
        use std::os::unix::io::AsRawFd;
        let fd = file.as_raw_fd();
        // SAFETY: fcntl on a descriptor this function owns, with integer arguments.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(file)
}

/// The whole of the regular file `path` (see [`open`]).
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    let mut f = open(path)?;
    let mut buf = Vec::new();
    // The length is a hint only: the file may change while it is read.
    let hint = f.metadata().map(|m| m.len()).unwrap_or(0);
    buf.try_reserve_exact(usize::try_from(hint).unwrap_or(0))
        .map_err(|_| io::Error::new(io::ErrorKind::OutOfMemory, "too large to read"))?;
    f.read_to_end(&mut buf)?;
    Ok(buf)
}

/// The whole of the regular file `path` as UTF-8 text (see [`open`]).
pub fn read_to_string(path: &Path) -> io::Result<String> {
    String::from_utf8(read(path)?).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "not UTF-8 text (invalid byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// The regular file `path`, mapped read-only (an empty file gives an empty map).
///
/// # Safety
/// As for every read-only map: the bytes change if another process rewrites the file
/// in place, and reading a page past its end after a truncation raises SIGBUS.
pub unsafe fn map(path: &Path) -> io::Result<memmap2::Mmap> {
    let f = open(path)?;
    // SAFETY: the caller takes on the map's contract (above).
    unsafe { memmap2::Mmap::map(&f) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_read_and_folders_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.txt");
        std::fs::write(&p, "hello").unwrap();
        assert_eq!(read_to_string(&p).unwrap(), "hello");
        // SAFETY: nothing changes the file while mapped.
        assert_eq!(&unsafe { map(&p) }.unwrap()[..], b"hello");
        let e = read(dir.path()).unwrap_err();
        assert_eq!(e.to_string(), "not a regular file (a folder)");
        assert_eq!(
            read(&dir.path().join("none")).unwrap_err().kind(),
            io::ErrorKind::NotFound
        );
        std::fs::write(&p, [0xff, b'a']).unwrap();
        assert!(read_to_string(&p)
            .unwrap_err()
            .to_string()
            .contains("offset 0"));
    }

    /// A FIFO with no writer: a plain open would block forever.
    #[cfg(unix)]
    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("fifo");
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = open(&p).unwrap_err();
        assert_eq!(e.to_string(), "not a regular file (a FIFO)");
    }

    #[cfg(unix)]
    #[test]
    fn a_device_is_refused() {
        if !Path::new("/dev/zero").exists() {
            return;
        }
        let e = read(Path::new("/dev/zero")).unwrap_err();
        assert_eq!(e.to_string(), "not a regular file (a character device)");
    }
}
