#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// The wall clock, for evaluation instants ("now" when a request gives none) and the dates
/// writes default to. One for the server, the fleet tailer and the CLI.
public enum WallClock {
    /// The current time in Unix milliseconds.
    public static func unixMilliseconds() -> Int64 {
        var spec = timespec()
        clock_gettime(CLOCK_REALTIME, &spec)
        return Int64(spec.tv_sec) * 1_000 + Int64(spec.tv_nsec) / 1_000_000
    }
}
