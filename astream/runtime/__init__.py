"""astream.runtime"""
