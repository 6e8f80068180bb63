//! Output files that appear whole or not at all.
//!
//! Every tool writes its output through [`AtomicFile`]: the bytes go to a file that has
//! no name in the target's folder, and only [`AtomicFile::commit`] (after an fsync) gives
//! it the target's name, replacing an existing file in one rename. A failed or
//! interrupted run leaves the target as it was.
//!
//! On Linux the temporary file is anonymous (`O_TMPFILE`): a process killed with SIGKILL
//! leaves nothing behind. Where the folder's file system has no `O_TMPFILE` (and on other
//! systems) it is a hidden `.NAME.tmp-PID` beside the target, removed on drop; only a
//! SIGKILL can leave that one behind. Commit links the anonymous file under such a name
//! and renames it at once, so that window is two system calls wide.

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// A file being written for `target`; see the module docs.
#[derive(Debug)]
pub struct AtomicFile {
    file: File,
    target: PathBuf,
    /// The named temporary file, when there is one (not `O_TMPFILE`).
    named: Option<PathBuf>,
}

fn tmp_path(target: &Path) -> io::Result<PathBuf> {
    let name = target.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "the output path has no file name",
        )
    })?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".tmp-{}", std::process::id()));
    Ok(target.with_file_name(tmp))
}

fn folder_of(target: &Path) -> &Path {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

impl AtomicFile {
    /// Starts writing `target`. Fails when the folder does not exist or cannot be
    /// written, or when `target` is a folder.
    pub fn create(target: &Path) -> io::Result<AtomicFile> {
        let tmp = tmp_path(target)?;
        if target.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::IsADirectory,
                "the output path is a folder",
            ));
        }
        #[cfg(target_os = "linux")]
        if let Some(file) = anonymous(folder_of(target))? {
            return Ok(AtomicFile {
                file,
                target: target.to_path_buf(),
                named: None,
            });
        }
        let file = File::create(&tmp)?;
        Ok(AtomicFile {
            file,
            target: target.to_path_buf(),
            named: Some(tmp),
        })
    }

    /// The path the file will have once committed.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Flushes the bytes to disk and gives the file its name, replacing any file there.
    pub fn commit(mut self) -> io::Result<()> {
        self.file.sync_all()?;
        let tmp = match self.named.take() {
            Some(tmp) => tmp,
            None => {
                let tmp = tmp_path(&self.target)?;
                #[cfg(target_os = "linux")]
                link_anonymous(&self.file, &tmp)?;
                tmp
            }
        };
        if let Err(e) = std::fs::rename(&tmp, &self.target) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        // The rename itself is durable once the folder is synced; not every file
        // system can sync a folder, so a failure here is not an error.
        if let Ok(dir) = File::open(folder_of(&self.target)) {
            let _ = dir.sync_all();
        }
        Ok(())
    }
}

/// Writes `bytes` as the whole of `path`, atomically.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = AtomicFile::create(path)?;
    f.write_all(bytes)?;
    f.commit()
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if let Some(tmp) = &self.named {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

impl Write for AtomicFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.file.write(buf)
    }
    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        self.file.write_all(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

impl Seek for AtomicFile {
    fn seek(&mut self, pos: SeekFrom) -> io::Result<u64> {
        self.file.seek(pos)
    }
}

/// An unnamed file in `dir`, or `None` when its file system has no `O_TMPFILE`.
#[cfg(target_os = "linux")]
fn anonymous(dir: &Path) -> io::Result<Option<File>> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .write(true)
        .mode(0o666)
        .custom_flags(libc::O_TMPFILE)
        .open(dir)
    {
        Ok(f) => Ok(Some(f)),
        // Kernels and file systems without O_TMPFILE answer with one of these.
        Err(e)
            if matches!(
                e.raw_os_error(),
                Some(libc::EOPNOTSUPP | libc::EISDIR | libc::EINVAL)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Gives the anonymous `file` the name `path` (through /proc, which needs no privilege).
#[cfg(target_os = "linux")]
fn link_anonymous(file: &File, path: &Path) -> io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::io::AsRawFd;
    let cstr = |b: &[u8]| {
        CString::new(b).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "NUL in path"))
    };
    let from = cstr(format!("/proc/self/fd/{}", file.as_raw_fd()).as_bytes())?;
    let to = cstr(path.as_os_str().as_bytes())?;
    // SAFETY: both are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    // Without /proc, AT_EMPTY_PATH does the same where the process may use it.
    let empty = cstr(b"")?;
    // SAFETY: as above; the descriptor is open for the whole call.
    let rc = unsafe {
        libc::linkat(
            file.as_raw_fd(),
            empty.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_EMPTY_PATH,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn commit_replaces_and_drop_leaves_the_target_alone() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.bin");
        std::fs::write(&out, b"old").unwrap();
        let mut f = AtomicFile::create(&out).unwrap();
        f.write_all(b"half").unwrap();
        // Nothing visible but the old file while writing (anonymous), or its hidden temp.
        assert!(names(dir.path())
            .iter()
            .all(|n| n == "out.bin" || n.starts_with(".out.bin.tmp-")));
        drop(f);
        assert_eq!(names(dir.path()), ["out.bin"]);
        assert_eq!(std::fs::read(&out).unwrap(), b"old");

        let mut f = AtomicFile::create(&out).unwrap();
        f.write_all(b"new bytes").unwrap();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.write_all(b"NEW").unwrap();
        f.commit().unwrap();
        assert_eq!(names(dir.path()), ["out.bin"]);
        assert_eq!(std::fs::read(&out).unwrap(), b"NEW bytes");
    }

    #[test]
    fn create_fails_on_a_folder_or_a_missing_folder() {
        let dir = tempfile::tempdir().unwrap();
        assert!(AtomicFile::create(dir.path()).is_err());
        assert!(AtomicFile::create(&dir.path().join("no/such/x")).is_err());
        assert!(names(dir.path()).is_empty());
    }

    #[cfg(unix)]
    #[test]
    fn committed_file_has_the_usual_permissions() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("p.bin");
        let f = AtomicFile::create(&out).unwrap();
        f.commit().unwrap();
        let plain = dir.path().join("q.bin");
        File::create(&plain).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&out), mode(&plain));
    }
}
