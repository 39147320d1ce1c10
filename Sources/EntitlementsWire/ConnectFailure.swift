public import NIOCore

#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Why a connection could not be made, in words a person can act on: `connection refused
/// (is the server running?)` rather than NIO's `Connection errors:
/// SingleConnectionFailure(target: ..., error: connection reset (error set): Connection
/// refused) (errno: 111))`. Used by every client of ours that connects (the Swift client and
/// the CLI through it, fleet mode's PostgreSQL connections).
public enum ConnectFailure {
    /// What went wrong, given the error of each attempt (one per address tried: NIO's
    /// `NIOConnectionError.connectionErrors`, or the one error), the name resolution's
    /// error when no address was found, and what was being reached (`the server`,
    /// `PostgreSQL`), for the hint.
    public static func reason(attempts: [any Error], resolution: (any Error)? = nil, service: String) -> String {
        if attempts.isEmpty, let resolution {
            return "cannot resolve the host name (\(resolution))"
        }
        var reasons: [String] = []
        for error in attempts {
            let reason = Self.reason(error, service: service)
            if !reasons.contains(reason) {
                reasons.append(reason)
            }
        }
        return reasons.isEmpty ? "no address to connect to" : reasons.joined(separator: "; ")
    }

    /// One attempt's error, phrased; `socketFile`: the attempt was on a Unix socket.
    public static func reason(_ error: any Error, service: String, socketFile: Bool = false) -> String {
        if let io = error as? IOError {
            switch io.errnoCode {
            case ECONNREFUSED where socketFile: return "connection refused (the socket file has no server behind it: is \(service) running?)"
            case ECONNREFUSED: return "connection refused (is \(service) running, on that port?)"
            case ENOENT: return "no such socket file (is \(service) running, with that socket?)"
            case EACCES, EPERM: return "permission denied (the socket file's mode or owner does not admit this user)"
            case ETIMEDOUT: return "timed out (is a firewall dropping packets?)"
            case EHOSTUNREACH, ENETUNREACH: return "no route to the host"
            case ECONNRESET: return "connection reset by the peer"
            case EADDRNOTAVAIL: return "address not available on this machine"
            default: return String(cString: strerror(io.errnoCode)).lowercased()
            }
        }
        if let channel = error as? ChannelError, case .connectTimeout(let amount) = channel {
            return "no connection within \(Double(amount.nanoseconds) / 1e9) s (is \(service) reachable from here?)"
        }
        return "\(error)"
    }
}
