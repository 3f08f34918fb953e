//! The processes a section starts, and what they cost: CPU seconds and resident memory, read
//! from `/proc` (Linux; elsewhere the readings are absent and the figures left out).

use std::process::Child;

/// Child processes of a section (coordinator, workers), each with its name; killed on drop.
pub(crate) struct Processes(pub(crate) Vec<(String, Child)>);

impl Drop for Processes {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// CPU seconds (user + system) a process has used, from `/proc/<pid>/stat` (USER_HZ = 100).
pub(crate) fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / 100.0)
}

/// A process's peak resident memory so far (`VmHWM`), KiB.
pub(crate) fn peak_rss_kib(pid: u32) -> Option<u64> {
    status_field(pid, "VmHWM:")
}

/// A process's resident memory now (`VmRSS`), KiB.
pub(crate) fn rss_kib(pid: u32) -> Option<u64> {
    status_field(pid, "VmRSS:")
}

/// A field of `/proc/<pid>/status` in KiB.
fn status_field(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}
