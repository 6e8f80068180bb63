//! Output files that appear whole or not at all, and never replace an input.
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
//! and renames it at once, so that window is two system calls wide. A name left behind
//! by an earlier killed run (PIDs repeat, in containers the tool is often PID 1) is
//! never reused: the next free `.NAME.tmp-PID-N` is taken instead.
//!
//! A target that exists and is not a regular file (a device such as `/dev/null`, a
//! FIFO, `/dev/stdout` on a terminal or pipe) is written directly and never renamed
//! over: replacing `/dev/null` with a regular file would break the system. Such a
//! target receives the bytes as they are written, so a failed run may have sent part
//! of them. A target that is a symlink to a regular file is replaced where the link
//! points (the link stays a link).
//!
//! [`check_not_input`] refuses an output that is the same file as one of the tool's
//! inputs (same device and inode: through symlinks and hard links), before any work.

use std::fs::File;
use std::io::{self, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// A file being written for `target`; see the module docs.
#[derive(Debug)]
pub struct AtomicFile {
    file: File,
    /// The path as the caller gave it.
    target: PathBuf,
    /// The path the committed file replaces: `target`, or where its symlink points.
    dest: PathBuf,
    mode: Mode,
}

#[derive(Debug)]
enum Mode {
    /// An `O_TMPFILE` file, named only at commit.
    Anonymous,
    /// A hidden temporary file with this name (no `O_TMPFILE`).
    Named(PathBuf),
    /// The target itself, which is not a regular file (a device, a FIFO).
    Direct,
}

/// Most temporary names tried before giving up (`.NAME.tmp-PID`, then `-1`, `-2`, ...).
const TMP_TRIES: u32 = 10_000;

/// The `attempt`-th temporary name for `dest`: `.NAME.tmp-PID`, then `.NAME.tmp-PID-N`.
fn tmp_path(dest: &Path, attempt: u32) -> io::Result<PathBuf> {
    let name = dest.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            "the output path has no file name",
        )
    })?;
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".tmp-{}", std::process::id()));
    if attempt > 0 {
        tmp.push(format!("-{attempt}"));
    }
    Ok(dest.with_file_name(tmp))
}

/// Calls `make` with fresh temporary names for `dest` until one does not exist yet.
fn fresh_tmp<T>(
    dest: &Path,
    mut make: impl FnMut(&Path) -> io::Result<T>,
) -> io::Result<(PathBuf, T)> {
    for attempt in 0..TMP_TRIES {
        let tmp = tmp_path(dest, attempt)?;
        match make(&tmp) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            r => return r.map(|t| (tmp, t)),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!(
            "{TMP_TRIES} temporary names beside it are taken ({})",
            tmp_path(dest, 0)?.display()
        ),
    ))
}

fn folder_of(target: &Path) -> &Path {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

impl AtomicFile {
    /// Starts writing `target`. Fails when the folder does not exist or cannot be
    /// written, or when `target` is a folder. A target that is a device or a FIFO is
    /// opened for writing as it is (a FIFO's open waits for a reader).
    pub fn create(target: &Path) -> io::Result<AtomicFile> {
        Self::create_as(target, true)
    }

    /// [`AtomicFile::create`]; `anonymous` false skips `O_TMPFILE` (tests of the
    /// named temporary file).
    fn create_as(target: &Path, anonymous: bool) -> io::Result<AtomicFile> {
        tmp_path(target, 0)?;
        match std::fs::metadata(target) {
            Ok(m) if m.is_dir() => {
                return Err(io::Error::new(
                    io::ErrorKind::IsADirectory,
                    "the output path is a folder",
                ))
            }
            Ok(m) if !m.is_file() => {
                let file = std::fs::OpenOptions::new().write(true).open(target)?;
                return Ok(AtomicFile {
                    file,
                    target: target.to_path_buf(),
                    dest: target.to_path_buf(),
                    mode: Mode::Direct,
                });
            }
            _ => {}
        }
        // A symlink to a file: replace the file it points to, not the link.
        let is_link = std::fs::symlink_metadata(target).is_ok_and(|m| m.file_type().is_symlink());
        let dest = match is_link {
            true => std::fs::canonicalize(target).unwrap_or_else(|_| target.to_path_buf()),
            false => target.to_path_buf(),
        };
        #[cfg(not(target_os = "linux"))]
        let _ = anonymous;
        #[cfg(target_os = "linux")]
        if let Some(file) = anonymous
            .then(|| tmpfile_in(folder_of(&dest)))
            .transpose()?
            .flatten()
        {
            return Ok(AtomicFile {
                file,
                target: target.to_path_buf(),
                dest,
                mode: Mode::Anonymous,
            });
        }
        let (tmp, file) = fresh_tmp(&dest, |p| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(p)
        })?;
        Ok(AtomicFile {
            file,
            target: target.to_path_buf(),
            dest,
            mode: Mode::Named(tmp),
        })
    }

    /// The path the file will have once committed.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Flushes the bytes to disk and gives the file its name, replacing any file there.
    pub fn commit(mut self) -> io::Result<()> {
        let tmp = match std::mem::replace(&mut self.mode, Mode::Direct) {
            Mode::Direct => {
                // Devices and FIFOs may not support fsync; the bytes were written.
                self.file.flush()?;
                let _ = self.file.sync_all();
                return Ok(());
            }
            Mode::Named(tmp) => {
                self.mode = Mode::Named(tmp.clone());
                self.file.sync_all()?;
                tmp
            }
            Mode::Anonymous => {
                self.file.sync_all()?;
                #[cfg(target_os = "linux")]
                let (tmp, ()) = fresh_tmp(&self.dest, |p| link_anonymous(&self.file, p))?;
                #[cfg(not(target_os = "linux"))]
                let tmp = unreachable!("O_TMPFILE is Linux only");
                // From here the name is ours to remove on failure.
                self.mode = Mode::Named(tmp.clone());
                tmp
            }
        };
        std::fs::rename(&tmp, &self.dest)?;
        self.mode = Mode::Direct; // renamed: nothing left to remove
                                  // The rename itself is durable once the folder is synced; not every file
                                  // system can sync a folder, so a failure here is not an error.
        if let Ok(dir) = File::open(folder_of(&self.dest)) {
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
        if let Mode::Named(tmp) = &self.mode {
            let _ = std::fs::remove_file(tmp);
        }
    }
}

/// Refuses `output` when it is the same file as one of `inputs`: same device and inode,
/// so a symlink or a hard link to an input is refused too. An output or input that
/// does not exist is no conflict. The error reads "the same file as the input X".
pub fn check_not_input<P: AsRef<Path>>(output: &Path, inputs: &[P]) -> io::Result<()> {
    let Ok(out) = std::fs::metadata(output) else {
        return Ok(());
    };
    for input in inputs {
        let input = input.as_ref();
        if let Ok(m) = std::fs::metadata(input) {
            if same_file(&out, &m) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "the same file as the input {}: refusing to overwrite an input",
                        input.display()
                    ),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(unix)]
fn same_file(a: &std::fs::Metadata, b: &std::fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    a.dev() == b.dev() && a.ino() == b.ino()
}

#[cfg(not(unix))]
fn same_file(_: &std::fs::Metadata, _: &std::fs::Metadata) -> bool {
    false
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
fn tmpfile_in(dir: &Path) -> io::Result<Option<File>> {
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
    let link = |dirfd: libc::c_int, from: &CString, flags: libc::c_int| {
        // SAFETY: both are valid NUL-terminated strings that outlive the call, and
        // `dirfd` is AT_FDCWD or the descriptor of `file`, open for the whole call.
        let rc = unsafe { libc::linkat(dirfd, from.as_ptr(), libc::AT_FDCWD, to.as_ptr(), flags) };
        if rc == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    };
    let e = match link(libc::AT_FDCWD, &from, libc::AT_SYMLINK_FOLLOW) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Err(e),
        Err(e) => e,
    };
    // Without /proc, AT_EMPTY_PATH does the same where the process may use it.
    let empty = cstr(b"")?;
    match link(file.as_raw_fd(), &empty, libc::AT_EMPTY_PATH) {
        Ok(()) => Ok(()),
        Err(e2) if e2.kind() == io::ErrorKind::AlreadyExists => Err(e2),
        Err(_) => Err(e),
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
    #[test]
    fn a_stale_temporary_name_is_skipped_not_reused() {
        // A SIGKILL between link and rename leaves `.NAME.tmp-PID`; a later run with
        // the same PID must neither fail on it nor truncate it.
        for anonymous in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let out = dir.path().join("out.bin");
            let stale = tmp_path(&out, 0).unwrap();
            std::fs::write(&stale, b"stale").unwrap();
            let mut f = AtomicFile::create_as(&out, anonymous).unwrap();
            f.write_all(b"new").unwrap();
            f.commit().unwrap();
            assert_eq!(std::fs::read(&out).unwrap(), b"new");
            assert_eq!(std::fs::read(&stale).unwrap(), b"stale");
            let stale_name = stale.file_name().unwrap().to_string_lossy().into_owned();
            assert_eq!(names(dir.path()), [stale_name, "out.bin".to_string()]);
        }
    }

    #[test]
    fn the_named_temporary_file_is_removed_on_drop() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out.bin");
        let mut f = AtomicFile::create_as(&out, false).unwrap();
        f.write_all(b"half").unwrap();
        assert_eq!(names(dir.path()).len(), 1);
        drop(f);
        assert!(names(dir.path()).is_empty());
    }

    #[cfg(unix)]
    fn mkfifo(p: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[cfg(unix)]
    #[test]
    fn a_fifo_target_is_written_directly_not_replaced() {
        use std::io::Read;
        use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        // A reader first (non-blocking), so the writer's open does not wait.
        let mut reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let mut f = AtomicFile::create(&fifo).unwrap();
        f.write_all(b"through the pipe").unwrap();
        f.commit().unwrap();
        let t = std::fs::symlink_metadata(&fifo).unwrap().file_type();
        assert!(t.is_fifo(), "the FIFO was replaced by {t:?}");
        let mut got = Vec::new();
        reader.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"through the pipe");
        assert_eq!(names(dir.path()), ["fifo"]);
    }

    /// A copy of /dev/null made with mknod (root only), so a regression renames over
    /// the copy, never over the system's /dev/null.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_device_target_is_written_directly_not_replaced() {
        use std::os::unix::ffi::OsStrExt;
        use std::os::unix::fs::FileTypeExt;
        let dir = tempfile::tempdir().unwrap();
        let dev = dir.path().join("null");
        let c = std::ffi::CString::new(dev.as_os_str().as_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path; makedev(1, 3) is /dev/null.
        let rc = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        if rc != 0 || std::fs::OpenOptions::new().write(true).open(&dev).is_err() {
            eprintln!("skipped: cannot make or open a device node here (needs root)");
            return;
        }
        write(&dev, b"gone").unwrap();
        let t = std::fs::symlink_metadata(&dev).unwrap().file_type();
        assert!(t.is_char_device(), "the device was replaced by {t:?}");
        assert_eq!(names(dir.path()), ["null"]);
    }

    #[cfg(unix)]
    #[test]
    fn a_symlink_target_is_replaced_where_it_points() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real.bin");
        let link = dir.path().join("link.bin");
        std::fs::write(&real, b"old").unwrap();
        std::os::unix::fs::symlink("real.bin", &link).unwrap();
        write(&link, b"new").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(std::fs::read(&real).unwrap(), b"new");
        assert_eq!(names(dir.path()), ["link.bin", "real.bin"]);
    }

    #[cfg(unix)]
    #[test]
    fn an_output_that_is_an_input_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let input = d.join("in.bin");
        std::fs::write(&input, b"x").unwrap();
        std::fs::write(d.join("other.bin"), b"x").unwrap();
        std::os::unix::fs::symlink("in.bin", d.join("sym.bin")).unwrap();
        std::fs::hard_link(&input, d.join("hard.bin")).unwrap();
        let inputs = [d.join("missing.bin"), input.clone()];
        for out in ["in.bin", "sym.bin", "hard.bin", "./in.bin"] {
            let e = check_not_input(&d.join(out), &inputs).unwrap_err();
            assert!(e.to_string().contains("in.bin"), "{out}: {e}");
        }
        for out in ["other.bin", "new.bin"] {
            check_not_input(&d.join(out), &inputs).unwrap();
        }
        // An input reached through a symlink is the file it points to.
        check_not_input(&input, &[d.join("sym.bin")]).unwrap_err();
    }
}
