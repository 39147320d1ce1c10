/// Why a byte stream is not a valid sequence of frames. Every case ends the connection:
/// the peer answers with an ERROR frame carrying ``status`` and ``description``, then closes.
public struct FrameError: Error, Hashable, CustomStringConvertible {
    /// The kind of problem.
    public enum Code: Sendable, Hashable {
        /// The first two bytes of a frame are not `EN` (0x45 0x4E).
        case badMagic
        /// The version byte is not one this side speaks.
        case unsupportedVersion
        /// The type byte names no frame type.
        case unknownFrameType
        /// The status byte is not a gRPC status code (0 to 16).
        case unknownStatusCode
        /// The payload length exceeds the configured maximum; nothing was allocated for it.
        case payloadTooLarge
        /// A CANCEL, PING or PONG frame carries a payload.
        case unexpectedPayload
        /// The connection ended in the middle of a frame.
        case truncated
    }

    /// The kind of problem.
    public var code: Code
    /// What is wrong, for people.
    public var description: String
    /// The offset in the connection's byte stream of the frame that was rejected.
    public var streamOffset: Int

    /// Creates an error.
    public init(code: Code, description: String, streamOffset: Int) {
        self.code = code
        self.description = description
        self.streamOffset = streamOffset
    }

    /// The status to put in the ERROR frame that reports this error to the peer.
    public var status: StatusCode {
        switch self.code {
        case .payloadTooLarge: .resourceExhausted
        case .unsupportedVersion: .unimplemented
        default: .invalidArgument
        }
    }
}
