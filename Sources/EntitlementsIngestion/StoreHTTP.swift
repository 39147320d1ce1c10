import AsyncHTTPClient
import EntitlementsFormats
import Logging
import NIOCore
import NIOHTTP1
import Synchronization

/// A store's HTTPS API as this server calls it (Google's: the Play Developer API with its
/// token exchange, Pub/Sub, Google's keys; Apple's App Store Server API): one client, a
/// timeout per call, and one back-off per API: after a 429, a 5xx or an unreachable host,
/// that API is not called until the back-off ends (1 s, doubling to 64 s, or the answer's
/// `Retry-After`), and what needed it is answered as a retry. Nothing is lost: the
/// notification comes again, the caller calls again.
final class StoreHTTP: Sendable {
    struct Answer: Sendable {
        var status: Int
        var body: [UInt8]
        /// `Cache-Control: max-age`, in seconds.
        var maxAge: Int64? = nil

        var json: EventJSON? { try? EventJSON(parsing: self.body) }

        /// The store's error message in the body, if any (Google's `error`, Apple's
        /// `errorMessage`).
        var message: String {
            let json = self.json
            return json?["error"]["message"].string ?? json?["error_description"].string ?? json?["error"].string ?? json?["errorMessage"].string
                ?? "HTTP \(self.status)"
        }
    }

    private let client: HTTPClient
    private let timeout: TimeAmount
    /// `generation` counts failures: a success resets the back-off only when no call
    /// failed since it started, so a slow success cannot clear a newer failure's back-off.
    private let backoff = Mutex<(failures: Int, until: NIODeadline?, why: String, generation: UInt64)>((0, nil, "", 0))
    /// The store, in messages ("Google", "Apple").
    private let service: String
    private let logger: Logger

    init(service: String = "Google", client: HTTPClient = .shared, timeout: TimeAmount = .seconds(15)) {
        self.service = service
        self.client = client
        self.timeout = timeout
        self.logger = Logger(label: "entitlements.\(service.lowercased())")
    }

    /// When the back-off ends, if one is under way.
    var backingOffUntil: NIODeadline? {
        self.backoff.withLock { state in
            guard let until = state.until, until > .now() else { return nil }
            return until
        }
    }

    func send(_ method: HTTPMethod, _ url: String, headers: [(String, String)] = [], body: [UInt8]? = nil, what: String) async throws(IngestionRetry) -> Answer {
        let (waiting, generation) = self.backoff.withLock { state -> ((NIODeadline, String)?, UInt64) in
            guard let until = state.until, until > .now() else { return (nil, state.generation) }
            return ((until, state.why), state.generation)
        }
        if let (until, why) = waiting {
            let seconds = Double((until - .now()).nanoseconds) / 1e9
            throw IngestionRetry(.storeUnavailable, "\(what): not called: backing off from \(self.service) for \(String(format: "%.1f", seconds)) s more after \(why)")
        }
        var request = HTTPClientRequest(url: url)
        request.method = method
        for (name, value) in headers {
            request.headers.add(name: name, value: value)
        }
        if let body {
            request.body = .bytes(ByteBuffer(bytes: body))
        } else if method == .POST {
            request.headers.add(name: "content-length", value: "0")
        }
        let answer: Answer
        do {
            let response = try await self.client.execute(request, timeout: self.timeout)
            let bytes = try await response.body.collect(upTo: 4 << 20)
            let maxAge = response.headers["cache-control"].flatMap { $0.split(separator: ",") }.lazy
                .map { $0.trimmingCharacters(in: .whitespaces) }.first { $0.hasPrefix("max-age=") }
                .flatMap { Int64($0.dropFirst("max-age=".count)) }
            answer = Answer(status: Int(response.status.code), body: Array(bytes.readableBytesView), maxAge: maxAge)
            if answer.status == 429 || answer.status >= 500 {
                let retryAfter = response.headers.first(name: "retry-after").flatMap { Int64($0) }.map { min(max($0, 1), 300) }
                throw self.failed("\(what): HTTP \(answer.status) (\(answer.message))", retryAfter: retryAfter)
            }
        } catch let retry as IngestionRetry {
            throw retry
        } catch {
            throw self.failed("\(what): \(error)", retryAfter: nil)
        }
        self.backoff.withLock { state in
            if state.generation == generation {
                state = (0, nil, "", generation)
            }
        }
        return answer
    }

    private func failed(_ why: String, retryAfter: Int64?) -> IngestionRetry {
        let delay = self.backoff.withLock { state -> TimeAmount in
            state.failures += 1
            state.generation &+= 1
            let exponential = TimeAmount.seconds(1 << Int64(min(state.failures - 1, 6)))
            let delay = retryAfter.map { TimeAmount.seconds($0) } ?? exponential
            // Never shorten a back-off under way (a concurrent failure's longer one).
            let until = NIODeadline.now() + delay
            state.until = max(state.until ?? until, until)
            state.why = why
            return delay
        }
        self.logger.warning("\(self.service) call failed; backing off", metadata: ["why": "\(why)", "seconds": "\(delay.nanoseconds / 1_000_000_000)"])
        return IngestionRetry(.storeUnavailable, why)
    }
}
