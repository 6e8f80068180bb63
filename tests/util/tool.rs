//! The one way the tests run a tool: `tool("mlb-convert").arg(..)` builds the command,
//! and one verb per outcome runs it. `.ok()` must succeed; `.fails()` must be a clean
//! refusal (a non-zero exit with a message, never a panic or a signal), so every refusal
//! test also proves the tool did not crash; `.output()` is the raw result, for the few
//! tests that look at signals or streams themselves.

use std::ffi::OsStr;
use std::io::{Read, Write};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::bin_path;

/// A package binary to run: [`Command`]'s builder, plus what its stdin gets and how long
/// it may take.
pub struct Tool {
    cmd: Command,
    stdin: Stdin,
    limit: Option<Duration>,
}

/// What the tool's stdin is.
enum Stdin {
    /// Empty (null).
    Empty,
    /// These bytes, then closed.
    Bytes(Vec<u8>),
    /// A pipe left open to the caller of [`Tool::spawn`].
    Open,
}

/// What a successful run printed: both streams as text (stdout lossily), and stdout's
/// bytes.
pub struct Ran {
    pub stdout: String,
    pub stderr: String,
    pub stdout_bytes: Vec<u8>,
}

/// One of the package's binaries (`mlb-convert`, `mlb-run`, ...), to build a command for.
pub fn tool(name: &str) -> Tool {
    Tool {
        cmd: Command::new(bin_path(name)),
        stdin: Stdin::Empty,
        limit: None,
    }
}

/// `mlb-convert input -o out`, to add flags to and run.
pub fn mlb_convert(input: &Path, out: &Path) -> Tool {
    let mut t = tool("mlb-convert");
    t.arg(input).arg("-o").arg(out);
    t
}

/// `mlb-export model -o out`, to add flags to and run.
pub fn mlb_export(model: &Path, out: &Path) -> Tool {
    let mut t = tool("mlb-export");
    t.arg(model).arg("-o").arg(out);
    t
}

/// `mlb-inspect args` in `dir` (the file names in `args` relative to it), to run.
pub fn mlb_inspect(dir: &Path, args: &[&str]) -> Tool {
    let mut t = tool("mlb-inspect");
    t.current_dir(dir).args(args);
    t
}

impl Tool {
    pub fn arg(&mut self, a: impl AsRef<OsStr>) -> &mut Self {
        self.cmd.arg(a);
        self
    }

    pub fn args<S: AsRef<OsStr>>(&mut self, a: impl IntoIterator<Item = S>) -> &mut Self {
        self.cmd.args(a);
        self
    }

    pub fn env(&mut self, key: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> &mut Self {
        self.cmd.env(key, value);
        self
    }

    pub fn current_dir(&mut self, dir: impl AsRef<Path>) -> &mut Self {
        self.cmd.current_dir(dir);
        self
    }

    /// The command underneath, for what the kit does not wrap (`pre_exec`).
    pub fn command(&mut self) -> &mut Command {
        &mut self.cmd
    }

    /// `input` on the tool's stdin, closed after it (without it, stdin is empty).
    pub fn stdin(&mut self, input: impl Into<Vec<u8>>) -> &mut Self {
        self.stdin = Stdin::Bytes(input.into());
        self
    }

    /// A stdin pipe that [`Tool::spawn`] leaves open, for the caller to write or close.
    pub fn stdin_open(&mut self) -> &mut Self {
        self.stdin = Stdin::Open;
        self
    }

    /// Kills the tool and fails the test if it runs longer than `limit` (a tool that
    /// hangs, on a FIFO say, must fail the test, not hang it).
    pub fn time_limit(&mut self, limit: Duration) -> &mut Self {
        self.limit = Some(limit);
        self
    }

    /// The command line, for messages.
    pub fn line(&self) -> String {
        format!("{:?}", self.cmd)
    }

    /// Runs the tool to its end: its status and both streams, whatever they are.
    pub fn output(&mut self) -> Output {
        if matches!(self.stdin, Stdin::Empty) && self.limit.is_none() {
            // Its own stdout if the caller set one through `command()`.
            return self.cmd.output().expect("spawn tool");
        }
        let mut child = self.spawn();
        drop(child.stdin.take());
        let Some(limit) = self.limit else {
            return child.wait_with_output().expect("wait for tool");
        };
        let read = |mut r: Box<dyn Read + Send>| {
            std::thread::spawn(move || {
                let mut v = Vec::new();
                let _ = r.read_to_end(&mut v);
                v
            })
        };
        let out = read(Box::new(child.stdout.take().unwrap()));
        let err = read(Box::new(child.stderr.take().unwrap()));
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = child.try_wait().expect("wait for tool") {
                break s;
            }
            if t0.elapsed() > limit {
                let _ = child.kill();
                let _ = child.wait();
                panic!("{}: still running after {limit:?} (hung)", self.line());
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        Output {
            status,
            stdout: out.join().unwrap(),
            stderr: err.join().unwrap(),
        }
    }

    /// Spawns the tool with stdout and stderr piped, for tests that talk to it or signal
    /// it while it runs. Its stdin is empty, or gets the bytes of [`Tool::stdin`] (from a
    /// thread, then closed), or is the pipe of [`Tool::stdin_open`].
    pub fn spawn(&mut self) -> Child {
        let stdin = match self.stdin {
            Stdin::Empty => Stdio::null(),
            Stdin::Bytes(_) | Stdin::Open => Stdio::piped(),
        };
        let mut child = self
            .cmd
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn tool");
        if let Stdin::Bytes(input) = &self.stdin {
            let (input, mut pipe) = (input.clone(), child.stdin.take().unwrap());
            // From a thread: a tool that writes before it has read all its input must
            // not wait on a test that is still writing. A tool may refuse before it
            // reads: a closed pipe is its answer, not an error here.
            std::thread::spawn(move || {
                let _ = pipe.write_all(&input);
            });
        }
        child
    }

    /// Runs the tool, which must exit 0 without a panic; panics with the command line and
    /// the tool's stderr otherwise.
    pub fn ok(&mut self) -> Ran {
        let o = self.output();
        let (stdout, stderr) = streams(&self.line(), &o);
        assert!(
            o.status.success() && !panicked(&stderr),
            "{} failed ({}):\n{stderr}",
            self.line(),
            o.status
        );
        Ran {
            stdout,
            stderr,
            stdout_bytes: o.stdout,
        }
    }

    /// Runs the tool, which must refuse cleanly: a non-zero exit status (not a signal,
    /// not Rust's panic status 101, no panic message in stderr) and a message on stderr.
    /// Returns the stderr.
    pub fn fails(&mut self) -> String {
        let line = self.line();
        refusal(&line, &self.output())
    }

    /// [`Tool::fails`] with exit status `code`.
    pub fn fails_with(&mut self, code: i32) -> String {
        let line = self.line();
        let o = self.output();
        let err = refusal(&line, &o);
        assert_eq!(o.status.code(), Some(code), "{line}: {err}");
        err
    }
}

/// The stderr of `o`, which must be a clean refusal ([`Tool::fails`]).
fn refusal(line: &str, o: &Output) -> String {
    let (stdout, stderr) = streams(line, o);
    let status = o.status;
    let why = if status.success() {
        "succeeded"
    } else if status.code().is_none() {
        "was killed by a signal"
    } else if status.code() == Some(101) || panicked(&stderr) {
        "panicked"
    } else if stderr.trim().is_empty() {
        "refused without a message"
    } else {
        return stderr;
    };
    panic!("{line} {why} ({status}) where a clean refusal was expected\nstderr:\n{stderr}\nstdout:\n{stdout}")
}

/// A Rust panic's message (or its backtrace hint) on a stream.
fn panicked(stderr: &str) -> bool {
    stderr.contains("panicked") || stderr.contains("RUST_BACKTRACE")
}

/// Both streams as text: stdout lossily (a generation may end inside a character),
/// stderr as it is, since the tools' messages are UTF-8.
fn streams(line: &str, o: &Output) -> (String, String) {
    let stderr = String::from_utf8(o.stderr.clone())
        .unwrap_or_else(|e| panic!("{line}: stderr is not UTF-8: {e}"));
    (String::from_utf8_lossy(&o.stdout).into_owned(), stderr)
}

#[test]
#[should_panic(expected = "succeeded")]
fn fails_refuses_a_success() {
    tool("mlb-inspect").arg("--help").fails();
}

#[test]
#[should_panic(expected = "failed")]
fn ok_refuses_a_refusal() {
    tool("mlb-inspect").arg("/nonexistent/x.mlb").ok();
}
